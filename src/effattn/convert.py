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

   the MSE of outputs, as LoLCATs' attention transfer; or, ``loss="ce"``, Hedgehog's
   cross-entropy of the attention weights, counted from the teacher's entropy (so 0 at a match):

       L = Σ_layers mean_{b,h,i} Σ_j P_ij (log P_ij - log A_ij),

   P the softmax weights, A the method's normalised weights (its output for the values I_M, so
   the fast path itself, window hybrids included; O(N M) memory per layer, as Hedgehog's
   loss). The teacher is computed on the fly inside
   each layer from the q, k, v it receives (no second model in memory), and the layer hands the
   teacher's output on, so that every layer trains on the softmax model's own hidden states and
   the layers do not wait on each other's progress (as LoLCATs does).
3. Fine-tuning afterwards is ordinary training: ``effattn train --init-from DIR`` (or
   ``effattn convert``, which runs the whole path on a task and measures every stage), of every
   weight or, with :func:`lora`, of low-rank adapters on the attention projections alone
   (LoRA, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", as LoLCATs
   fine-tunes): each projection weight W (out x in) becomes

       W + (alpha / r) B A,    A (r x in), B (out x r), B = 0 at the start,

   so the model is unchanged until B trains; :func:`merge_lora` folds B A into W.

Hugging Face decoders (a ``LlamaForCausalLM`` and others whose attention goes through
transformers' ``AttentionInterface``) are linearized through effattn's ``attn_implementation``
(:mod:`effattn.integrations.transformers`): :func:`linearize` sets ``effattn-<method>``, keeping
every weight, and builds each layer's effattn module (the submodule ``effattn`` of each attention
module) by one short forward; :func:`transfer` matches exact softmax on the q, k, v the model's
attention function receives, and :func:`lora` adapts the ``q_proj``, ``k_proj``, ``v_proj`` and
``o_proj`` linears. ``generate()`` then decodes with ``RecurrentCache``'s fixed-size state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from effattn.base import AttentionMethod
from effattn.nn.attention import MultiheadAttention, swap
from effattn.nn.blocks import TransformerBlock, check_capability
from effattn.registry import DEFAULT_METHOD, build, spec

__all__ = ["LoRA", "attention_layers", "layer_errors", "linearize", "lora", "merge_lora",
           "transfer"]

# Adam's step size for attention transfer: LoLCATs trains its feature maps with 1e-2.
TRANSFER_LR = 1e-2
# Gradient-norm clip of each transfer step, as the training loop's.
GRAD_CLIP = 1.0
# What attention transfer matches: the layers' outputs (LoLCATs) or their weights (Hedgehog).
TRANSFER_LOSSES = ("mse", "ce")


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
    module holding ``effattn.nn.MultiheadAttention``), a torch model built from
    ``torch.nn.MultiheadAttention``, or a Hugging Face decoder (needs the ``hf`` extra; see
    :func:`linearize_hf`); the layers keep their projections (and a call input's projection
    that the new method uses too), and lose the old mechanism's own state.
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
    if _is_hugging_face(model):
        return linearize_hf(model, method, **options)
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


def _is_hugging_face(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (duck-typed: transformers is an optional extra)."""
    return callable(getattr(model, "set_attn_implementation", None)) and hasattr(model, "config")


def linearize_hf(model: nn.Module, method: str, **options: Any) -> dict[str, nn.Parameter]:
    """:func:`linearize` for a Hugging Face decoder: its attention implementation becomes
    ``effattn-<method>`` (registered here), every weight kept; returns the parameters of the
    layers' new effattn modules (``<attention module>.effattn.*``).

    ``options``: the method's options, stored as ``model.config.effattn_options`` (per model);
    ``seed`` becomes ``config.effattn_seed`` (layer i draws with seed + i). Each attention
    module's effattn module is built by one forward of two tokens (the integration builds them
    at their first call; building them now lets a caller hand their parameters to an
    optimizer). ``ValueError`` for a method without a causal form, a model whose attention does
    not go through transformers' ``AttentionInterface``, or options the method does not take
    (``TypeError``).
    """
    from effattn.integrations import transformers as hf

    check_capability(method, "causal", f"{type(model).__name__}'s causal self-attention")
    seed = options.pop("seed", getattr(model.config, "effattn_seed", 0))
    build(method, head_dim=8, heads=1, **options)  # unknown options fail now, by name
    hf.register(method)
    model.config.effattn_options = dict(options)
    model.config.effattn_seed = seed
    model.set_attn_implementation(hf.name(method))
    if model.config._attn_implementation != hf.name(method):
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation "
                         "(its attention does not go through transformers' AttentionInterface)")
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    if not _mechanisms(model):
        raise ValueError(f"{type(model).__name__} has no attention that calls "
                         f"{hf.name(method)}: nothing was converted")
    return {name: p for name, p in model.named_parameters() if "effattn" in name.split(".")}


def _mechanisms(model: nn.Module) -> list[AttentionMethod]:
    """The attention mechanisms of ``model``'s layers: effattn's ``MultiheadAttention``'s
    ``attn``, and the ``effattn`` submodule of a Hugging Face attention module."""
    found = [layer.attn for _, layer in attention_layers(model)]
    found += [m.effattn for m in model.modules()
              if isinstance(getattr(m, "effattn", None), AttentionMethod)]
    return found


def _teacher(attn: AttentionMethod) -> nn.Module:
    """Exact softmax attention at the mechanism's scale (the softmax layer's, 1/√D, unless one
    was given)."""
    return build(DEFAULT_METHOD, head_dim=attn.head_dim, heads=attn.heads, scale=attn.scale)


def _converted(model: nn.Module) -> list[AttentionMethod]:
    """The attention mechanisms of ``model`` that are not the exact one; ``ValueError`` when
    there are none (nothing to match to softmax)."""
    layers = [attn for attn in _mechanisms(model) if attn.spec.name != DEFAULT_METHOD]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer with a method other "
                         f"than {DEFAULT_METHOD} to match ({DEFAULT_METHOD} is the teacher): "
                         "linearize it first")
    return layers


def _check_loss(loss: str) -> None:
    if loss not in TRANSFER_LOSSES:
        raise ValueError(f"loss must be one of {', '.join(TRANSFER_LOSSES)}, got {loss!r}")


def _weights_loss(module: nn.Module, teacher: nn.Module, args: tuple,
                  kwargs: dict[str, Any]) -> Tensor:
    """Σ_j P_ij (log P_ij - log A_ij) averaged over the queries that see a key: P the exact
    softmax weights, A ``module``'s, each read as the attention's output for the values I_M."""
    q, k = args[:2]
    m = k.shape[2]
    eye = torch.eye(m, dtype=q.dtype, device=q.device).expand(*k.shape[:2], m, m)
    with torch.no_grad():
        p = teacher(q, k, eye, causal=kwargs.get("causal", False),
                    key_padding_mask=kwargs.get("key_padding_mask")).float()
    # forward, not __call__: the layer's hooks (this one among them) must not run again.
    a = module.forward(q, k, eye, *args[3:], **kwargs).float()
    # A signed map's negative weights have no log: they are clamped (no gradient there).
    log_a = a.clamp_min(torch.finfo(torch.float32).tiny).log()
    per_query = (torch.xlogy(p, p) - p * log_a).sum(-1)
    return per_query[p.sum(-1) > 0.5].mean()


@contextmanager
def _matching(model: nn.Module, losses: list[Tensor], loss: str = "mse") -> Iterator[None]:
    """Inside, each non-exact attention layer of ``model`` appends its transfer ``loss`` against
    exact softmax on the same q, k, v (``mse``: of the outputs; ``ce``: of the weights, see the
    module docstring) to ``losses`` and passes the softmax output on."""
    _check_loss(loss)
    layers = _converted(model)

    def hook(teacher: nn.Module) -> Callable[..., Tensor]:
        def run(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Tensor) -> Tensor:
            q, k, v = args[:3]
            with torch.no_grad():
                target = teacher(q, k, v, causal=kwargs.get("causal", False),
                                 key_padding_mask=kwargs.get("key_padding_mask"))
            losses.append(F.mse_loss(out.float(), target.float()) if loss == "mse"
                          else _weights_loss(module, teacher, args, kwargs))
            return target
        return run

    handles = [attn.register_forward_hook(hook(_teacher(attn)), with_kwargs=True)
               for attn in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _calibrate(model: nn.Module, layers: list[AttentionMethod], inputs: Any) -> None:
    """Window hybrids with a factor (``window_factor=True``) start from the factor that gives the
    estimate softmax's mass outside the window on the first batch
    (:func:`effattn.kernelized.hybrid.calibrate_factor`): the scale of a learned or fixed map's
    kernel is arbitrary, and Adam moves the log-factor by about its step size per step. Random
    features that estimate exp of the logits (``estimates_exp``) keep their factor of 1: the
    median over queries of a skewed estimate's log-ratio is not 0 even where the mean ratio is
    1 (it gave performer e^1.5 on charlm, and a worse converted model)."""
    from effattn.kernelized.hybrid import calibrate_factor

    hybrids = [attn for attn in layers if getattr(attn, "window_log_factor", None) is not None
               and not attn.estimates_exp]
    if not hybrids:
        return

    def run(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        q, k = args[:2]
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        calibrate_factor(module, q.to(dtype), k.to(dtype), causal=kwargs.get("causal", False),
                         key_padding_mask=kwargs.get("key_padding_mask"))

    handles = [attn.register_forward_pre_hook(run, with_kwargs=True) for attn in hybrids]
    try:
        with torch.no_grad(), _matching(model, []):  # every layer sees softmax's hidden states
            _call(model, inputs)
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


def layer_errors(model: nn.Module, inputs: Any, loss: str = "mse") -> list[float]:
    """Each converted layer's transfer ``loss`` against exact softmax on the same q, k, v (the
    MSE of its attention output, or ``ce``: the cross-entropy of its weights past the teacher's
    entropy), for one batch ``inputs`` (a tensor, a tuple of positional or a dict of keyword
    arguments of ``model``); each layer sees the softmax model's hidden states."""
    losses: list[Tensor] = []
    with _eval_with_grad(model), torch.no_grad(), _matching(model, losses, loss):
        _call(model, inputs)
    return [float(loss) for loss in losses]


def transfer(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    steps: int,
    parameters: Iterable[nn.Parameter] | Mapping[str, nn.Parameter] | None = None,
    lr: float = TRANSFER_LR,
    loss: str = "mse",
) -> list[float]:
    """Attention transfer: train ``parameters`` alone for ``steps`` Adam steps so that each
    converted layer matches exact softmax on the same q, k, v, by the MSE of its outputs
    (``loss="mse"``, LoLCATs) or the cross-entropy of its weights (``"ce"``, Hedgehog; see the
    module docstring); returns the loss (summed over layers) of every step.

    ``batches``: model inputs, one per step (a tensor, a tuple of positional or a dict of keyword
    arguments of ``model``); ``parameters``: what :func:`linearize` returned (default: the
    parameters of the layers' mechanisms and call-input projections). The model runs in eval
    mode (no dropout, no redraw of random features); every other parameter is frozen meanwhile
    and its ``requires_grad`` restored afterwards.

    ``ValueError`` when there is nothing to train (a method without parameters of its own, such
    as random features: fine-tune it instead), for ``steps`` < 1, an unknown ``loss``, or when
    ``batches`` runs out.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    _check_loss(loss)
    layers = _converted(model)
    if parameters is None:
        # The mechanisms' own parameters and, in effattn's layers, their call inputs'
        # projections (gated RFA's gate).
        parameters = [p for attn in layers for p in attn.parameters()]
        parameters += [p for _, layer in attention_layers(model) if not layer.exact
                       for name, p in layer.named_parameters()
                       if name.startswith(tuple(f"{c}_proj." for c in layer.call_inputs))]
    elif isinstance(parameters, Mapping):
        parameters = list(parameters.values())
    trainable = list(parameters)
    if not trainable:
        methods = sorted({attn.spec.name for attn in layers})
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
                if step == 0:
                    _calibrate(model, layers, inputs)
                losses: list[Tensor] = []
                with _matching(model, losses, loss):
                    _call(model, inputs)
                total = torch.stack(losses).sum()
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                nn.utils.clip_grad_norm_(trainable, GRAD_CLIP)
                optimizer.step()
                history.append(float(total.detach()))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return history


class LoRA(nn.Module):
    """A low-rank update of a weight W (out x in), as a parametrization
    (``torch.nn.utils.parametrize``): ``W + scaling · B A`` with ``scaling = alpha / rank``.

    ``blocks`` splits W's rows into that many equal parts with an adapter each: torch's and
    effattn's packed ``in_proj_weight`` (3E x E) holds W_q, W_k and W_v, and each gets its own
    rank-``rank`` update, as separate q, k, v projections would. A: (blocks, rank, in), Kaiming
    uniform as nn.Linear's weight; B: (blocks, out / blocks, rank), zeros.
    """

    def __init__(self, weight: Tensor, rank: int, alpha: float, blocks: int = 1) -> None:
        super().__init__()
        out, fan_in = weight.shape
        if out % blocks:
            raise ValueError(f"a weight of {out} rows cannot be split into {blocks} blocks")
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(blocks, rank, fan_in, **factory))
        self.lora_B = nn.Parameter(torch.zeros(blocks, out // blocks, rank, **factory))
        for a in self.lora_A:
            nn.init.kaiming_uniform_(a, a=5 ** 0.5)
        self.scaling = alpha / rank

    def forward(self, weight: Tensor) -> Tensor:
        delta = torch.bmm(self.lora_B, self.lora_A).reshape(weight.shape)
        return weight + self.scaling * delta

    def extra_repr(self) -> str:
        blocks, rank, _ = self.lora_A.shape
        return f"rank={rank}, scaling={self.scaling:g}, blocks={blocks}"


# Projection weights of one attention layer that LoRA adapts, as (module attribute path, blocks).
_TORCH_STYLE = (("in_proj_weight", 3), ("q_proj_weight", 1), ("k_proj_weight", 1),
                ("v_proj_weight", 1), ("out_proj.weight", 1))
_HF_STYLE = (("q_proj.weight", 1), ("k_proj.weight", 1), ("v_proj.weight", 1),
             ("o_proj.weight", 1))


def _projection_weights(model: nn.Module) -> list[tuple[str, nn.Module, str, int]]:
    """(qualified name, owning module, attribute, blocks) of every attention projection weight:
    effattn's and torch's ``MultiheadAttention`` (packed or separate q, k, v and ``out_proj``)
    and attention modules with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` linears (Llama and
    most Hugging Face decoders)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.MultiheadAttention, MultiheadAttention)):
            targets = _TORCH_STYLE
        elif all(isinstance(getattr(module, p, None), nn.Linear)
                 for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            targets = _HF_STYLE
        else:
            continue
        for path, blocks in targets:
            owner_path, _, attr = path.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            if isinstance(getattr(owner, attr, None), Tensor):
                found.append((f"{name}.{path}" if name else path, owner, attr, blocks))
    return found


def lora(model: nn.Module, rank: int = 8, alpha: float = 16.0) -> dict[str, nn.Parameter]:
    """Add low-rank adapters (:class:`LoRA`) to the q, k, v and output projection weights of
    every attention layer of ``model`` in place, freeze every other parameter, and return the
    adapters' parameters by qualified name (what an optimizer should train).

    The model computes exactly what it did until the adapters train (B starts at zero). The
    adapters live in ``state_dict`` (``<layer>.parametrizations.<weight>.0.lora_A`` / ``lora_B``,
    the frozen weight as ``....original``): a checkpoint of an adapted model loads into a model
    adapted the same way; :func:`merge_lora` folds them into plain weights.

    ``ValueError`` for a rank or alpha that is not positive, a model without attention
    projections, or one that already has adapters.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    targets = _projection_weights(model)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no attention projections to adapt "
                         "(effattn's or torch's MultiheadAttention, or q/k/v/o_proj linears)")
    if any(isinstance(m, LoRA) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters: merge_lora first")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, owner, attr, blocks in targets:
        parametrize.register_parametrization(
            owner, attr, LoRA(getattr(owner, attr), rank, float(alpha), blocks))
    return {name: p for name, p in model.named_parameters() if ".lora_" in name}


def merge_lora(model: nn.Module) -> int:
    """Fold every :class:`LoRA` adapter of ``model`` into its weight (``W + scaling · B A``) and
    remove it, in place: the model computes the same, with plain weights and ``state_dict`` keys
    again (the merged weights keep the frozen weights' ``requires_grad``). Returns the number of
    weights merged (0 for a model without adapters).

    ``ValueError`` when a weight has another parametrization besides its adapter.
    """
    merged = 0
    for module in list(model.modules()):
        if not parametrize.is_parametrized(module):
            continue
        for attr, chain in list(module.parametrizations.items()):
            if not any(isinstance(p, LoRA) for p in chain):
                continue
            if len(chain) != 1:
                raise ValueError(f"{type(module).__name__}.{attr} has other parametrizations "
                                 "besides its LoRA adapter: remove them first")
            requires_grad = chain.original.requires_grad
            parametrize.remove_parametrizations(module, attr, leave_parametrized=True)
            getattr(module, attr).requires_grad_(requires_grad)
            merged += 1
    return merged
