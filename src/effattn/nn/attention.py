"""Multi-head attention with a pluggable mechanism: a drop-in for ``torch.nn.MultiheadAttention``.

out = W_o · concat_h attn_h(x_q W_q^h + b_q^h, x_k W_k^h + b_k^h, x_v W_v^h + b_v^h) + b_o, where
attn is any registered method (``effattn.methods()``). The constructor, the defaults
(``batch_first=False``: inputs (L, B, E)), the parameters and the ``state_dict`` keys are torch's
(``in_proj_weight``, or ``q/k/v_proj_weight`` when kdim/vdim differ; ``in_proj_bias``,
``out_proj``, ``bias_k``/``bias_v``), so torch's weights load into it and its weights load into
torch's; the keyword ``method=`` picks the mechanism.

Where it differs from torch's module (the exact method is ``DEFAULT_METHOD``, softmax):

- ``attn_mask`` may only be the causal mask (bool True or float -inf above the diagonal): a
  sub-quadratic method never forms the N x M score matrix, so it cannot apply an arbitrary mask.
  Any other mask raises ``ValueError``, for every method alike.
- ``need_weights=True`` returns the attention weights from the exact method only (computed as torch
  does); other methods never form them and return ``None``.
- attention-weight ``dropout`` and ``add_bias_kv``/``add_zero_attn`` exist for the exact method
  only; other methods refuse them at construction.
- a query whose keys are all masked outputs 0 (torch: NaN), as every effattn method does.
- ``key``/``value`` default to ``query``; ``is_causal=True`` needs no ``attn_mask``.
- torch's Transformer layers never replace its forward by their fused softmax kernel in inference
  (see ``_qkv_same_embed_dim`` below), and nested-tensor inputs are refused.

Two kinds of mechanism change the layer itself, as their spec says:

- one with required call inputs (``spec.required_inputs``): the layer computes each from the
  query input, with a module of its own registered as ``<name>_proj`` (a parameter that torch's
  module has not), and hands it to the mechanism by name. The one such input is ``gate`` (gated
  RFA): a per-head gate g = sigmoid(x W_g + b_g), (B, H, N) (Peng et al. 2021, eq. 7); a
  mechanism that needs an input no layer computes is refused at construction. Such inputs are
  computed for self-attention only.
- a parameter-free mixer (``layer.parameter_free``: FNet's 2-D Fourier transform), which has no
  queries, keys or values. The layer has no projections at all and mixes the full embedding (one
  "head" of size E), as in Lee-Thorp et al. 2021; ``num_heads`` is only checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from effattn.registry import DEFAULT_METHOD, build, spec


@dataclass
class CrossState:
    """A decoder's cross-attention memory, prepared once per source.

    ``memory`` is the mechanism's own (:meth:`effattn.base.AttentionMethod.memory`): the
    projected keys and values (B, H, M, D) for most methods, the fixed-size [S, z] of the
    projected source for kernelized ones.
    """

    memory: Any


def layer_seed(seed: int | None, index: int) -> int | None:
    """A distinct, reproducible seed for the index-th attention layer of a model."""
    return None if seed is None else seed * 1000 + index


def gate_bias_init(num_heads: int) -> Tensor:
    """Initial gate biases: per-head forgetting timescales spread from 2 to 64 tokens.

    With b = 0 every gate starts at 0.5, i.e. the memory halves at each token and the layer begins
    as a purely local mixer that must learn to remember. Spreading the initial g_h = 1 - 1/tau_h
    over tau_h in [2, 64] (geometrically) starts some heads local and some long-range, the same
    idea as RetNet's per-head decay rates; training moves them freely from there.
    """
    tau = torch.logspace(1.0, 6.0, num_heads, base=2.0) if num_heads > 1 else torch.tensor([8.0])
    g = 1.0 - 1.0 / tau
    return torch.log(g / (1.0 - g))


class GateProjection(nn.Linear):
    """The call input ``gate``: g = sigmoid(x W_g + b_g) per head, x (B, N, E) -> (B, H, N).

    Small input weights, so that the initial gates sit at their biases' timescales
    (:func:`gate_bias_init`).
    """

    def __init__(self, embed_dim: int, num_heads: int, **factory: Any) -> None:
        super().__init__(embed_dim, num_heads, **factory)
        with torch.no_grad():
            self.weight.mul_(0.1)
            self.bias.copy_(gate_bias_init(num_heads))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(super().forward(x)).transpose(1, 2)


# The call inputs a layer computes from its query input, by CallInput.name: a module class taking
# (embed_dim, num_heads, device=, dtype=), registered on the layer as ``<name>_proj``.
PRODUCERS: dict[str, type[nn.Module]] = {"gate": GateProjection}


def _blocked(mask: Tensor, arg: str) -> Tensor:
    """A torch-style mask as bool, True where attention is blocked.

    bool: True blocks; float: additive, so only 0 (keep) and -inf (block) say "keep or block"; any
    other value is a bias on the scores, which no sub-quadratic method can add.
    """
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"{arg} must be bool or float, got dtype {mask.dtype}")
    blocked = mask == float("-inf")
    if not bool((blocked | (mask == 0)).all()):
        raise ValueError(
            f"a float {arg} may only hold 0 (keep) and -inf (mask): other values are an additive "
            "bias on the attention scores, which sub-quadratic methods never form"
        )
    return blocked


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` whose core is ``effattn.build(method, ...)``.

    Args (torch's, with torch's defaults):
        embed_dim: E, model width; must be divisible by ``num_heads``.
        num_heads: H; each head has D = E / H.
        dropout: dropout on the attention weights in training; exact method only.
        bias: biases on the input and output projections.
        add_bias_kv: learned key/value (1, 1, E) appended to the keys and values; exact method only.
        add_zero_attn: a zero key/value appended to each head; exact method only.
        kdim, vdim: feature sizes of key and value inputs (default E).
        batch_first: inputs (B, L, E) if True, (L, B, E) if False (default, as torch).
        device, dtype: of the parameters.
    Keyword-only (effattn's):
        method: a registered mechanism name (default: exact softmax attention).
        max_len: longest sequence (needed by methods with length-dependent parameters).
        seed: fixes the mechanism's random draws.
        **options: the mechanism's own options (``effattn.spec(method).options``).
    """

    # torch's Transformer layers read ``_qkv_same_embed_dim`` (with ``batch_first`` and
    # ``in_proj_bias``) to decide whether their fused inference kernel, softmax attention over
    # ``in_proj_weight``, may run instead of ``self_attn``'s forward. It never may here: the
    # mechanism is ``method``, not torch's softmax. Whether q, k, v are packed is ``packed``.
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        method: str = DEFAULT_METHOD,
        max_len: int | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        for arg, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}"
            )
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (
            0.0 <= dropout <= 1.0
        ):
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        method_spec = spec(method)
        self.exact = method == DEFAULT_METHOD
        if not self.exact and dropout:
            raise ValueError(
                f"dropout={dropout}: attention dropout drops attention weights, which only "
                f"{DEFAULT_METHOD} forms; {method} never forms them. Use dropout=0.0 (for a "
                "converted torch module: from_torch(module, method, dropout=0.0))"
            )
        if not self.exact and (add_bias_kv or add_zero_attn):
            raise ValueError(
                f"add_bias_kv and add_zero_attn are supported with method={DEFAULT_METHOD!r} only: "
                "they append a key that every query sees, which breaks causal attention and the "
                f"window, bucket and landmark layouts of sub-quadratic methods ({method})"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.packed = self.kdim == embed_dim and self.vdim == embed_dim
        self.method = method
        # The call inputs this layer computes and hands to the mechanism, by name.
        self.call_inputs = tuple(c.name for c in method_spec.required_inputs(options))
        cannot = [name for name in self.call_inputs if name not in PRODUCERS]
        if cannot:
            raise ValueError(
                f"{method} needs the call input(s) {', '.join(cannot)}, which "
                f"MultiheadAttention cannot compute (it computes {', '.join(PRODUCERS)})"
            )
        self.add_zero_attn = add_zero_attn
        self.parameter_free = method_spec.layer.parameter_free
        factory = {"device": device, "dtype": dtype}
        # torch's parameters, registered in torch's order and initialised as torch does, so that
        # the same global seed gives the same weights as torch's module.
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                     "in_proj_bias"):
            self.register_parameter(name, None)
        self.out_proj = self.bias_k = self.bias_v = None
        if self.parameter_free:
            if not self.packed:
                raise ValueError(f"{method} mixes one sequence: kdim/vdim must equal embed_dim")
            self.attn = build(method, head_dim=embed_dim, heads=1, max_len=max_len, seed=seed,
                              **options)
        else:
            if self.packed:
                self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            else:
                self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
                self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
                self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            if bias:
                self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
            self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias,
                                                            **factory)
            if add_bias_kv:
                self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
                self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self._reset_parameters()
            self.attn = build(method, head_dim=self.head_dim, heads=num_heads, max_len=max_len,
                              seed=seed, **options)
        if device is not None or dtype is not None:
            self.attn.to(**factory)
        # When set, the mechanism runs through it instead of self.attn (same call): each
        # process's q, k, v are its slice of the sequence (effattn.distributed.training). A plain
        # callable, not a submodule, so that parameters and state_dict stay the mechanism's.
        self.sequence_parallel: Callable[..., Tensor] | None = None
        for name in self.call_inputs:
            setattr(self, f"{name}_proj", PRODUCERS[name](embed_dim, num_heads, **factory))

    def _reset_parameters(self) -> None:
        """torch's: Xavier-uniform input weights, zero biases, Xavier-normal bias_k/bias_v."""
        for weight in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight,
                       self.v_proj_weight):
            if weight is not None:
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        for extra in (self.bias_k, self.bias_v):
            if extra is not None:
                nn.init.xavier_normal_(extra)

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, method: str = DEFAULT_METHOD, **kwargs: Any
    ) -> MultiheadAttention:
        """A layer with ``module``'s settings and weights, using ``method`` inside.

        ``kwargs`` override the constructor's arguments (``dropout=0.0`` for a method that cannot
        drop attention weights) or are ``max_len``, ``seed`` and the method's options.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(
                f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}"
            )
        weight = module.out_proj.weight
        settings = {
            "dropout": module.dropout, "bias": module.in_proj_bias is not None,
            "add_bias_kv": module.bias_k is not None, "add_zero_attn": module.add_zero_attn,
            "kdim": module.kdim, "vdim": module.vdim, "batch_first": module.batch_first,
            "device": weight.device, "dtype": weight.dtype,
        }
        new = cls(module.embed_dim, module.num_heads, method=method, **{**settings, **kwargs})
        if new.parameter_free:
            raise ValueError(f"{method} has no projections to copy weights into")
        # The layouts are the same: every key of torch's state_dict is one of ours; ours adds the
        # mechanism's own state (random features, generators) and its call inputs' projections.
        missing, unexpected = new.load_state_dict(module.state_dict(), strict=False)
        own = ("attn.", *(f"{name}_proj." for name in new.call_inputs))
        ours = [k for k in missing if not k.startswith(own)]
        if unexpected or ours:
            raise ValueError(f"cannot copy {module}: missing {ours}, unexpected {unexpected}")
        return new

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, method={self.method!r}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}, "
                f"call_inputs={self.call_inputs}")

    def _check_input(self, arg: str, x: Tensor, dim: int, batched: bool = True) -> None:
        if isinstance(x, Tensor) and x.is_nested:
            raise ValueError(
                f"{arg} is a nested tensor, which this module does not take (torch's "
                "nn.TransformerEncoder makes them in inference when built with "
                "enable_nested_tensor=True; set its use_nested_tensor = False, as swap() does)"
            )
        ndim = 3 if batched else 2
        if not isinstance(x, Tensor) or x.dim() != ndim or x.shape[-1] != dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
            raise ValueError(
                f"{arg} must be 3-D {layout} with E={dim}, or 2-D (L, E) unbatched like the "
                f"query; got {shape}"
            )

    def _weights(self) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
        """(W_q, W_k, W_v), (b_q, b_k, b_v) in torch's packed or separate layout."""
        if self.packed:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        return weights, biases

    def _split(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _heads(self, x: Tensor, index: int) -> Tensor:
        """Projection ``index`` (0: q, 1: k, 2: v) of x (B, L, *) as heads (B, H, L, D)."""
        weights, biases = self._weights()
        return self._split(F.linear(x, weights[index], biases[index]))

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, ...]:
        if self.packed and key is query and value is query:
            # Self-attention: one (3E x E) matmul, as torch does.
            return tuple(map(self._split, F.linear(query, self.in_proj_weight,
                                                   self.in_proj_bias).chunk(3, -1)))
        return tuple(self._heads(x, i) for i, x in enumerate((query, key, value)))

    def _merge(self, o: Tensor) -> Tensor:
        b, _, n, _ = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.embed_dim))

    def _call(self, x: Tensor) -> dict[str, Tensor]:
        """The call inputs of the mechanism, computed from the query input x (B, N, E)."""
        return {name: getattr(self, f"{name}_proj")(x) for name in self.call_inputs}

    def _padding(self, key_padding_mask: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
        """``key_padding_mask`` as bool (B, M), True marking padding."""
        if key_padding_mask is None:
            return None
        if not isinstance(key_padding_mask, Tensor) or tuple(key_padding_mask.shape) != shape:
            got = getattr(key_padding_mask, "shape", type(key_padding_mask).__name__)
            raise ValueError(f"key_padding_mask must have shape (B, M) = {shape}, got {got}")
        return _blocked(key_padding_mask, "key_padding_mask")

    def _causal(self, attn_mask: Tensor | None, is_causal: bool, n: int, m: int) -> bool:
        """Whether attention is causal: ``is_causal``, or ``attn_mask`` being the causal mask."""
        if attn_mask is None:
            return is_causal
        if not isinstance(attn_mask, Tensor) or attn_mask.dim() not in (2, 3) or (
            tuple(attn_mask.shape[-2:]) != (n, m)
        ):
            got = getattr(attn_mask, "shape", type(attn_mask).__name__)
            raise ValueError(f"attn_mask must be (N, M) or (B*H, N, M) with N={n}, M={m}, "
                             f"got {got}")
        blocked = _blocked(attn_mask, "attn_mask")
        future = torch.ones(n, m, dtype=torch.bool, device=blocked.device).triu(1)
        if n != m or not torch.equal(blocked, future.expand_as(blocked)):
            raise ValueError(
                "attn_mask must be the causal mask (True or -inf above the diagonal): "
                f"{self.method} takes no other, since sub-quadratic methods never form the N x M "
                "score matrix that an arbitrary mask would edit (the layer refuses it for every "
                "method alike). Use is_causal=True for causal masking, key_padding_mask for "
                "padding, and attn_mask=None"
            )
        return True

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of ``query`` over ``key``/``value`` (both default to ``query``).

        query (L, B, E) or (B, L, E) per ``batch_first``, or (L, E) unbatched; key (S, B, kdim),
        value (S, B, vdim) likewise. key_padding_mask (B, S): bool True, or float -inf, marks
        padding. attn_mask: only the causal mask (N, N) or (B*H, N, N). Returns ``(out,
        weights)``: out shaped like query; weights (B, N, S) averaged over heads or (B, H, N, S)
        with ``need_weights`` and the exact method, else ``None``.
        """
        self_attention = key is None and value is None
        key = query if key is None else key
        value = key if value is None else value
        same = self_attention or (key is query and value is query)
        batched = isinstance(query, Tensor) and query.dim() == 3
        self._check_input("query", query, self.embed_dim, batched)
        self._check_input("key", key, self.kdim, batched)
        self._check_input("value", value, self.vdim, batched)
        if not batched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if query.shape[0] != key.shape[0] or key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"query, key, value disagree in batch or length: query {tuple(query.shape)}, "
                f"key {tuple(key.shape)}, value {tuple(value.shape)} (batch_first=True layout)"
            )
        if same:
            key = value = query
        (b, n, _), m = query.shape, key.shape[1]
        padding = self._padding(key_padding_mask, (b, m))
        causal = self._causal(attn_mask, is_causal, n, m)
        if self.call_inputs and not same:
            raise ValueError(
                f"{self.method} takes {', '.join(self.call_inputs)} at call time, which the layer "
                "computes for self-attention only"
            )
        call = self._call(query)
        weights = None
        if self.parameter_free:
            if not same:
                raise ValueError(f"{self.method} mixes one sequence: key/value must be the query")
            x = query[:, None]
            out = self.attn(x, x, x, causal=causal, key_padding_mask=padding)[:, 0]
        else:
            q, k, v = self._project(query, key, value)
            dropout = self.dropout if self.training else 0.0
            if self.exact and (need_weights or dropout or self.bias_k is not None
                               or self.add_zero_attn):
                o, p = self._explicit_softmax(q, k, v, causal, padding, dropout)
                if need_weights:
                    weights = p.mean(1) if average_attn_weights else p
                    weights = weights if batched else weights[0]
            else:
                attend = self.attn if self.sequence_parallel is None else self.sequence_parallel
                o = attend(q, k, v, causal=causal, key_padding_mask=padding, **call)
            out = self._merge(o)
        if not batched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _explicit_softmax(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, padding: Tensor | None,
        dropout: float,
    ) -> tuple[Tensor, Tensor]:
        """Exact attention with the weights P = dropout(softmax(scale q k^T + mask)) formed, as
        torch's module does when it returns them: q (B, H, N, D), k, v (B, H, M, D) ->
        (P v (B, H, N, D), P (B, H, N, M')), M' = M + the bias_kv / zero-attention keys.

        The appended keys are seen by every query, the padding and causal masks cover the M
        others; a query with no visible key gets P = 0, as the mechanism gives.
        """
        b, h, n, m = *q.shape[:3], k.shape[2]
        blocked = torch.zeros(b, 1, n, m, dtype=torch.bool, device=q.device)
        if causal:
            if n != m:
                raise ValueError(f"causal attention needs N == M, got N={n}, M={m}")
            blocked = blocked | torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        if padding is not None:
            blocked = blocked | padding[:, None, None, :]
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self._split(self.bias_k.expand(b, 1, -1)))
            extra_v.append(self._split(self.bias_v.expand(b, 1, -1)))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(b, h, 1, k.shape[3]))
            extra_v.append(v.new_zeros(b, h, 1, v.shape[3]))
        if extra_k:
            k, v = torch.cat((k, *extra_k), 2), torch.cat((v, *extra_v), 2)
            blocked = F.pad(blocked, (0, len(extra_k)), value=False)
        scores = (q * self.attn.scale) @ k.transpose(-2, -1)
        p = torch.softmax(scores.masked_fill(blocked, float("-inf")), -1)
        p = p.masked_fill(blocked.all(-1, keepdim=True), 0.0)
        if dropout:
            p = F.dropout(p, dropout)
        return p @ v, p

    def step(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        """One step of causal self-attention for decoding: x (B, 1, E) (or (1, B, E)).

        ``state`` is the mechanism's own decoding state (``None`` to start): a KV cache for
        softmax, a fixed-size (S, z) for kernelized methods. Feeding a sequence one token at a time
        equals ``forward(x, is_causal=True)``. Returns ``(out, state)``.
        """
        return self._decode(x, state, "step")

    def prefill(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        """Causal self-attention over a block x (B, L, E) that continues ``state``, in the
        mechanism's parallel form; equals L calls to :meth:`step`. Returns ``(out, state)``."""
        return self._decode(x, state, "prefill")

    def _check_decodable(self, how: str) -> None:
        if self.parameter_free:
            reason = spec(self.method).refusals.get("decoding", "not supported")
            raise ValueError(f"{self.method} cannot do recurrent decoding ({how}): {reason}")
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(f"{how}: decoding does not support add_bias_kv or add_zero_attn")

    def _decode(self, x: Tensor, state: Any, how: str) -> tuple[Tensor, Any]:
        self._check_input("x", x, self.embed_dim)
        if not self.batch_first:
            x = x.transpose(0, 1)
        if how == "step" and x.shape[1] != 1:
            raise ValueError(f"step takes one token per sequence, got x of shape {tuple(x.shape)}")
        self._check_decodable(how)
        o, state = getattr(self.attn, how)(*self._project(x, x, x), state, **self._call(x))
        out = self._merge(o)
        return (out if self.batch_first else out.transpose(0, 1)), state

    def cross_state(
        self, key: Tensor, value: Tensor | None = None, key_padding_mask: Tensor | None = None
    ) -> CrossState:
        """Project the memory key (B, M, kdim) and value (default: key) once for
        :meth:`cross_step` during decoding."""
        if self.parameter_free:
            raise ValueError(f"{self.method} has no cross-attention form")
        self._check_decodable("cross_state")
        value = key if value is None else value
        self._check_input("key", key, self.kdim)
        self._check_input("value", value, self.vdim)
        if not self.batch_first:
            key, value = key.transpose(0, 1), value.transpose(0, 1)
        padding = self._padding(key_padding_mask, tuple(key.shape[:2]))
        return CrossState(self.attn.memory(self._heads(key, 1), self._heads(value, 2), padding))

    def cross_step(self, x: Tensor, state: CrossState) -> Tensor:
        """Cross-attention of decoder queries x (B, L, E) (one step: L = 1) over a projected
        memory."""
        self._check_input("x", x, self.embed_dim)
        if not self.batch_first:
            x = x.transpose(0, 1)
        o = self.attn.attend_memory(self._heads(x, 0), state.memory)
        out = self._merge(o)
        return out if self.batch_first else out.transpose(0, 1)


def swap(model: nn.Module, method: str = DEFAULT_METHOD, **options: Any) -> nn.Module:
    """Replace, in place, every ``torch.nn.MultiheadAttention`` of ``model`` by effattn's, with the
    same settings and weights (:meth:`MultiheadAttention.from_torch`), and return ``model``.

    ``options`` go to ``from_torch`` (``max_len``, the method's options, constructor overrides
    such as ``dropout=0.0``); ``seed`` becomes a distinct seed per layer. A model that is itself
    a torch ``MultiheadAttention`` is returned converted. torch's ``TransformerEncoder`` turns
    padded batches into nested tensors in inference: swapped encoders stop (``use_nested_tensor
    = False``). A layer whose call the method cannot do (a decoder's causal self-attention with a
    non-causal method) raises, at call time, ``ValueError`` with the method's reason.
    """
    seed = options.pop("seed", None)
    if isinstance(model, nn.MultiheadAttention):
        return MultiheadAttention.from_torch(model, method, seed=seed, **options)
    converted: dict[int, MultiheadAttention] = {}
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.MultiheadAttention):
                if id(child) not in converted:  # a shared module stays shared
                    converted[id(child)] = MultiheadAttention.from_torch(
                        child, method, seed=layer_seed(seed, len(converted)), **options)
                setattr(parent, name, converted[id(child)])
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False
    return model
