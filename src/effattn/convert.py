"""Convert a trained softmax model to a linear-time method, keeping its weights: linearize, then
attention transfer (LoLCATs, Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large
Language Models"; Hedgehog, Zhang et al. 2024, ICLR 2024).

1. :func:`linearize` switches every attention layer of a model (effattn's models, torch models
   built from ``nn.MultiheadAttention``) to ``method`` in place, keeping every projection weight,
   and returns the parameters the new method adds (hedgehog's feature maps, gated RFA's gate
   projection, a learned Taylor projection): everything else is the trained model's.
2. :func:`transfer` trains those new parameters alone so that each layer's attention output
   matches exact softmax attention on the same q, k, v:

       L = Σ_layers mean_{b,h,n,d} (attn_method(q, k, v) - softmax(scale q kᵀ [+ mask]) v)²

   the MSE of outputs, as LoLCATs' attention transfer. The teacher is computed on the fly inside
   each layer from the q, k, v it receives (no second model in memory), and the layer hands the
   teacher's output on, so that every layer trains on the softmax model's own hidden states and
   the layers do not wait on each other's progress (as LoLCATs does).
3. Fine-tuning of every weight afterwards is ordinary training: ``effattn train --init-from DIR``
   (or ``effattn convert``, which runs the whole path on a task and measures every stage).

Hugging Face models take effattn through ``attn_implementation``
(:mod:`effattn.integrations.transformers`), whose modules are built at their first call:
:func:`linearize` does not convert them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from effattn.nn.attention import MultiheadAttention, swap
from effattn.nn.blocks import TransformerBlock, check_capability
from effattn.registry import DEFAULT_METHOD, build, spec

__all__ = ["attention_layers", "layer_errors", "linearize", "transfer"]

# Adam's step size for attention transfer: LoLCATs trains its feature maps with 1e-2.
TRANSFER_LR = 1e-2
# Gradient-norm clip of each transfer step, as the training loop's.
GRAD_CLIP = 1.0


def attention_layers(model: nn.Module) -> list[tuple[str, MultiheadAttention]]:
    """The effattn attention layers of ``model`` by qualified name, each once."""
    seen: set[int] = set()
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MultiheadAttention) and id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


def linearize(model: nn.Module, method: str, *, decoding: bool = False,
              **options: Any) -> dict[str, nn.Parameter]:
    """Switch every attention layer of ``model`` to ``method`` in place, keeping every weight;
    return the parameters the method adds, by qualified name (empty for a method without any,
    such as performer's random features or plain linear attention).

    ``model``: an effattn model (``DecoderLM``, ``EncoderClassifier``, ``EncoderDecoder``, any
    module holding ``effattn.nn.MultiheadAttention``) or a torch model built from
    ``torch.nn.MultiheadAttention``; the layers keep their projections (and a call input's
    projection that the new method uses too), and lose the old mechanism's own state.
    ``decoding=True`` requires a method that decodes with a recurrent state.
    ``options``: the method's options, ``max_len``, ``seed`` (a distinct one per layer) and layer
    overrides such as ``dropout=0.0`` (see :func:`effattn.nn.swap`).

    Raises ``KeyError`` for an unregistered method (listing the valid ones), ``ValueError`` for a
    model with no attention layer, a single layer (convert it with
    ``MultiheadAttention.from_torch``, which returns a new one), a method that cannot decode when
    ``decoding`` is asked, or a causal layer given a method without a causal form.
    """
    method_spec = spec(method)
    if decoding and not method_spec.decoding:
        raise ValueError(f"decoding=True, but {method} cannot decode with a recurrent state: "
                         f"{method_spec.refusals['decoding']}")
    if isinstance(model, (nn.MultiheadAttention, MultiheadAttention)):
        raise ValueError("linearize converts a model in place; a single attention layer is "
                         "converted into a new one by MultiheadAttention.from_torch(layer, method)")
    for module in model.modules():
        if isinstance(module, TransformerBlock) and module.causal:
            check_capability(method, "causal", f"{type(model).__name__}'s causal self-attention")
        if isinstance(module, TransformerBlock) and module.cross_attn is not None:
            check_capability(method, "cross", f"{type(model).__name__}'s cross-attention")
    layers = [name for name, m in model.named_modules()
              if isinstance(m, (nn.MultiheadAttention, MultiheadAttention))]
    # The old mechanisms' own state goes with them; every other weight is kept.
    owned = tuple(f"{name}.attn." if name else "attn." for name in layers)
    kept = {name for name, _ in model.named_parameters() if not name.startswith(owned)}
    swap(model, method, **options)
    return {name: p for name, p in model.named_parameters() if name not in kept}


def _teacher(layer: MultiheadAttention) -> nn.Module:
    """Exact softmax attention at the layer mechanism's scale (the softmax layer's, 1/√D,
    unless one was given)."""
    attn = layer.attn
    teacher = build(DEFAULT_METHOD, head_dim=layer.head_dim, heads=layer.num_heads,
                    scale=attn.scale)
    return teacher.to(layer.out_proj.weight.device)


def _converted(model: nn.Module) -> list[MultiheadAttention]:
    """The attention layers of ``model`` whose method is not the exact one; ``ValueError`` when
    there are none (nothing to match to softmax)."""
    layers = [layer for _, layer in attention_layers(model) if not layer.exact]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer with a method other "
                         f"than {DEFAULT_METHOD} to match ({DEFAULT_METHOD} is the teacher): "
                         "linearize it first")
    return layers


@contextmanager
def _matching(model: nn.Module, losses: list[Tensor]) -> Iterator[None]:
    """Inside, each non-exact attention layer of ``model`` appends the MSE between its
    mechanism's output and exact softmax on the same q, k, v to ``losses`` and passes the
    softmax output on."""
    layers = _converted(model)

    def hook(teacher: nn.Module) -> Callable[..., Tensor]:
        def run(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Tensor) -> Tensor:
            q, k, v = args[:3]
            with torch.no_grad():
                target = teacher(q, k, v, causal=kwargs.get("causal", False),
                                 key_padding_mask=kwargs.get("key_padding_mask"))
            losses.append(F.mse_loss(out.float(), target.float()))
            return target
        return run

    handles = [layer.attn.register_forward_hook(hook(_teacher(layer)), with_kwargs=True)
               for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


@contextmanager
def _eval_with_grad(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, no redraw of random features), restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def layer_errors(model: nn.Module, inputs: Any) -> list[float]:
    """The MSE between each converted layer's attention output and exact softmax on the same
    q, k, v, for one batch ``inputs`` (a tensor, a tuple of positional or a dict of keyword
    arguments of ``model``); each layer sees the softmax model's hidden states."""
    losses: list[Tensor] = []
    with _eval_with_grad(model), torch.no_grad(), _matching(model, losses):
        _call(model, inputs)
    return [float(loss) for loss in losses]


def transfer(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int,
    parameters: Iterable[nn.Parameter] | Mapping[str, nn.Parameter] | None = None,
    lr: float = TRANSFER_LR,
) -> list[float]:
    """Attention transfer: train ``parameters`` alone for ``steps`` Adam steps so that each
    converted layer's output matches exact softmax on the same q, k, v (see the module
    docstring); returns the loss (summed over layers) of every step.

    ``batches``: model inputs, one per step (a tensor, a tuple of positional or a dict of keyword
    arguments of ``model``); ``parameters``: what :func:`linearize` returned (default: the
    parameters of the layers' mechanisms and call-input projections). The model runs in eval
    mode (no dropout, no redraw of random features); every other parameter is frozen meanwhile
    and its ``requires_grad`` restored afterwards.

    ``ValueError`` when there is nothing to train (a method without parameters of its own, such
    as random features: fine-tune it instead), for ``steps`` < 1, or when ``batches`` runs out.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    layers = _converted(model)
    if parameters is None:
        parameters = [p for layer in layers for name, p in layer.named_parameters()
                      if name.startswith(("attn.", *(f"{c}_proj." for c in layer.call_inputs)))]
    elif isinstance(parameters, Mapping):
        parameters = list(parameters.values())
    trainable = list(parameters)
    if not trainable:
        methods = sorted({layer.method for layer in layers})
        raise ValueError(f"nothing to transfer: {', '.join(methods)} adds no parameters to the "
                         "model (a fixed feature map); fine-tune the model instead")
    train_ids = {id(p) for p in trainable}
    frozen = [p for p in model.parameters() if id(p) not in train_ids and p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=lr)
    history: list[float] = []
    batch_iter = iter(batches)
    for p in frozen:
        p.requires_grad_(False)
    try:
        with _eval_with_grad(model):
            for step in range(steps):
                try:
                    inputs = next(batch_iter)
                except StopIteration:
                    raise ValueError(f"batches ran out after {step} of {steps} steps") from None
                losses: list[Tensor] = []
                with _matching(model, losses):
                    _call(model, inputs)
                loss = torch.stack(losses).sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(trainable, GRAD_CLIP)
                optimizer.step()
                history.append(float(loss.detach()))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return history
