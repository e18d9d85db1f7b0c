"""The module every mechanism derives from: input validation and capability checks in one place.

Subclasses implement ``_attend`` (and ``_step`` when ``spec.decoding``); :meth:`forward` and
:meth:`step` validate the inputs against the contract of ``shared/design.md`` first, so a method's
own code only ever sees well-formed tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from effattn.registry import MethodSpec


def check_qkv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument when q, k, v or the mask break the contract.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv), key_padding_mask: bool (B, M).
    Shapes, dtypes and devices are always checked; NaN/inf only in eager mode (not while
    ``torch.compiler.is_compiling()``).
    """
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{arg} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{arg} must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            "q, k, v must agree in batch and heads (B, H): got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the head dim D: got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must have the same length M: got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if min(q.shape[2], k.shape[2]) == 0:
        raise ValueError(f"empty sequence: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal=True needs N == M, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise ValueError(
                "key_padding_mask must be a bool tensor (True marks padding), got "
                f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}"
            )
        expected = (k.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must have shape (B, M) = {expected}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != k.device:
            raise ValueError(
                f"key_padding_mask is on {key_padding_mask.device}, k on {k.device}"
            )
    if torch.compiler.is_compiling():
        # Reading values is a host sync, and a graph break under torch.compile: compiled
        # callers get the shape and dtype checks above, eager ones this one too.
        return
    for arg, t in (("q", q), ("k", k), ("v", v)):
        # One reduction pass; the elementwise check runs only when the sum is not finite
        # (a NaN/inf, or an overflowing sum of finite values, which is not an error).
        if not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
            raise ValueError(f"{arg} contains NaN or inf (shape {tuple(t.shape)})")


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1, else a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a ValueError naming the option.

    Only ``True``/``False``: ``bool("false")`` is True, so coercing would turn a string from a
    command line or a config file into the opposite of what it says.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError naming the option."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def resolve_seed(seed: int | None) -> int:
    """``seed``, or a seed drawn from the global RNG when None.

    Drawing from the global RNG keeps ``torch.manual_seed`` in control of unseeded modules.
    """
    return seed if seed is not None else int(torch.randint(0, 2**62, ()).item())


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are computed in fp32 (features overflow in half precision)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class KeyValueMemory:
    """Keys and values that many later query blocks attend to (cross-attention in decoding).

    The generic form keeps them as they are: k (B, H, M, D), v (B, H, M, Dv), key_padding_mask
    (B, M) or None; kernelized methods summarise them instead (see
    :meth:`AttentionMethod.memory`).
    """

    k: Tensor
    v: Tensor
    key_padding_mask: Tensor | None


class AttentionMethod(nn.Module):
    """Base class of every registered mechanism.

    Args:
        head_dim: D, the size of each query/key head.
        heads: H; methods with per-head parameters use it, all check it.
        max_len: longest sequence the module will see (needed by methods with
            length-dependent parameters such as Linformer).
        seed: fixes the method's random draws.
        scale: logit scale, default ``1/sqrt(head_dim)`` as in SDPA.
    """

    spec: ClassVar[MethodSpec]

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        if scale is not None and (not isinstance(scale, (int, float)) or scale <= 0):
            raise ValueError(f"scale must be a positive number or None, got {scale!r}")
        self.head_dim = head_dim
        self.heads = heads
        self.max_len = max_len
        self.seed = seed
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, heads={self.heads}, scale={self.scale:.4g}"

    def _refuse(self, capability: str, what: str) -> None:
        reason = self.spec.refusals.get(capability, "not supported")
        raise ValueError(f"{self.spec.name} cannot do {what}: {reason}")

    def _check(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None
    ) -> None:
        check_qkv(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        if q.shape[1] != self.heads:
            raise ValueError(
                f"q has {q.shape[1]} heads, the module was built with heads={self.heads}"
            )
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q has head dim {q.shape[-1]}, the module was built with head_dim={self.head_dim}"
            )
        if causal and not self.spec.causal:
            self._refuse("causal", "causal attention")
        if key_padding_mask is not None and not self.spec.padding_mask:
            self._refuse("padding_mask", "a key padding mask")
        if q.shape[2] != k.shape[2] and not self.spec.cross:
            self._refuse("cross", f"cross-attention (N={q.shape[2]} != M={k.shape[2]})")
        if self.max_len is not None and max(q.shape[2], k.shape[2]) > self.max_len:
            raise ValueError(
                f"sequence length {max(q.shape[2], k.shape[2])} exceeds max_len={self.max_len}"
            )

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Attention of q (B, H, N, D) over k (B, H, M, D), v (B, H, M, Dv) -> (B, H, N, Dv)."""
        self._check(q, k, v, causal, key_padding_mask)
        out = self._attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **kwargs)
        return out.to(q.dtype)

    def _check_decoding(self, q: Tensor, k: Tensor, v: Tensor, what: str) -> None:
        if not self.spec.decoding:
            self._refuse("decoding", f"recurrent decoding ({what})")
        check_qkv(q, k, v, causal=True)
        if q.shape[1] != self.heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q has shape {tuple(q.shape)}, the module was built with heads={self.heads}, "
                f"head_dim={self.head_dim}"
            )

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, state: Any = None, **kwargs: Any
    ) -> tuple[Tensor, Any]:
        """One decoding step: q, k, v of shape (B, H, 1, D); returns (out (B, H, 1, Dv), state).

        Feeding a sequence one token at a time from ``state=None`` gives the causal forward.
        """
        if q.shape[2:3] != (1,) or k.shape[2:3] != (1,):
            raise ValueError(
                f"step takes one token: q, k, v must be (B, H, 1, D), got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}"
            )
        self._check_decoding(q, k, v, "step")
        out, state = self._step(q, k, v, state, **kwargs)
        return out.to(q.dtype), state

    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, state: Any = None, **kwargs: Any
    ) -> tuple[Tensor, Any]:
        """Causal attention over a block of L tokens that continues ``state`` (None: the start).

        q, k, v: (B, H, L, D); returns (out (B, H, L, Dv), state after the block). The parallel
        form of L calls to :meth:`step`: a prompt is prefilled in one call, then decoded.
        """
        self._check_decoding(q, k, v, "prefill")
        out, state = self._prefill(q, k, v, state, **kwargs)
        return out.to(q.dtype), state

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Any:
        """Prepare k (B, H, M, D), v (B, H, M, Dv) for :meth:`attend_memory`, once.

        For a decoder's cross-attention: every step attends to the same source. The generic
        memory keeps k and v (each read costs O(M)); kernelized methods fold them into the
        fixed-size state [S, z] = φ(K)^T [V, 1], so that each read costs O(F Dv) whatever M is.
        """
        check_qkv(k[:, :, :1], k, v, key_padding_mask=key_padding_mask)
        self._check_heads(k)
        if not self.spec.cross:
            self._refuse("cross", "cross-attention over a memory")
        return self._memory(k, v, key_padding_mask)

    def attend_memory(self, q: Tensor, memory: Any) -> Tensor:
        """Non-causal attention of q (B, H, N, D) over a :meth:`memory` -> (B, H, N, Dv).

        Equals ``forward(q, k, v, key_padding_mask=mask)`` for the k, v, mask it was made from.
        """
        if not isinstance(q, Tensor) or q.dim() != 4 or not q.is_floating_point():
            raise ValueError(
                f"q must be a floating-point (B, H, N, D) tensor, got {getattr(q, 'shape', q)}"
            )
        self._check_heads(q)
        return self._attend_memory(q, memory).to(q.dtype)

    def _check_heads(self, x: Tensor) -> None:
        if x.shape[1] != self.heads or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"expected (B, H={self.heads}, L, D={self.head_dim}), got {tuple(x.shape)}"
            )

    def _memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Any:
        return KeyValueMemory(k, v, key_padding_mask)

    def _attend_memory(self, q: Tensor, memory: Any) -> Tensor:
        if not isinstance(memory, KeyValueMemory):
            raise ValueError(
                f"memory must come from {self.spec.name}.memory(), got {type(memory).__name__}"
            )
        return self(q, memory.k, memory.v, key_padding_mask=memory.key_padding_mask)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
    ) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _attend")

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement _step")

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        """One :meth:`_step` per token; methods with a parallel causal form override this."""
        outs = []
        for t in range(q.shape[2]):
            one = slice(t, t + 1)
            out, state = self._step(q[:, :, one], k[:, :, one], v[:, :, one], state)
            outs.append(out)
        return torch.cat(outs, 2), state


@torch.library.custom_op("effattn::draw", mutates_args=("state",))
def _draw(
    state: Tensor, shape: list[int], normal: bool, dtype: torch.dtype, when: Tensor | None
) -> Tensor:
    """Standard normal (``normal``) or uniform [0, 1) values of ``shape`` from the CPU generator
    whose state is ``state``, advanced in place; zeros, and the state left alone, where ``when``
    (0-d bool) is False.

    An operator rather than a ``torch.Generator`` call because torch.compile cannot trace a
    generator: it traces this as one opaque node, so modules that draw compile fullgraph.
    """
    if when is not None and not bool(when):
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator()
    g.set_state(state)
    out = (torch.randn if normal else torch.rand)(shape, generator=g, dtype=dtype)
    state.copy_(g.get_state())
    return out


@_draw.register_fake
def _(state: Tensor, shape: list[int], normal: bool, dtype: torch.dtype,
      when: Tensor | None) -> Tensor:
    return torch.empty(shape, dtype=dtype)


class TensorGenerator:
    """A CPU random generator held as its state tensor (uint8, as ``torch.Generator.get_state``).

    Draws the same numbers as a ``torch.Generator`` with that state, through the ``effattn::draw``
    operator, which torch.compile traces (it cannot trace a ``torch.Generator``). ``when`` (0-d
    bool tensor, optional) makes every draw conditional: False gives zeros and leaves the state
    alone, a branch that needs no host sync under compile.
    """

    def __init__(self, state: Tensor, when: Tensor | None = None) -> None:
        self.state = state
        self.when = when

    @staticmethod
    def seeded(seed: int) -> Tensor:
        """The state of a CPU generator seeded with ``seed``."""
        return torch.Generator().manual_seed(seed).get_state()

    def normal(self, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """N(0, 1) draws of ``shape``, as ``torch.randn(*shape, generator=g, dtype=dtype)``."""
        return _draw(self.state, list(shape), True, dtype, self.when)

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
        """U[0, 1) draws of ``shape``, as ``torch.rand(*shape, generator=g, dtype=dtype)``."""
        return _draw(self.state, list(shape), False, dtype, self.when)


# Where random draws come from: a torch.Generator, the global RNG (None), or a TensorGenerator
# (what modules use, so that they compile).
RandomSource = torch.Generator | TensorGenerator | None


def normal(generator: RandomSource, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """N(0, 1) draws of ``shape`` from ``generator`` (see :data:`RandomSource`)."""
    if isinstance(generator, TensorGenerator):
        return generator.normal(*shape, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype)


def uniform(generator: RandomSource, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """U[0, 1) draws of ``shape`` from ``generator`` (see :data:`RandomSource`)."""
    if isinstance(generator, TensorGenerator):
        return generator.uniform(*shape, dtype=dtype)
    return torch.rand(shape, generator=generator, dtype=dtype)


class RandomizedAttention(AttentionMethod):
    """Base of the methods that keep drawing random numbers after construction.

    It owns the module's random state and saves it with the ``state_dict`` (as extra state), so
    that a checkpoint loaded into a fresh build, whatever that build's ``seed``, continues
    exactly as the saved module would have:

    - ``_rng``: the state of a CPU generator seeded with the seed; training-mode draws (fresh
      random blocks, rotations or subsets on every call, redrawn random features) advance it;
    - ``_seed``: eval-mode draws restart from its generator state on every call, so eval calls
      repeat them;
    - ``_calls``: training-mode forward calls so far (redraw schedules count them).

    The generator state and the counter are CPU tensors, updated in place, not a
    ``torch.Generator`` and a Python int: torch.compile traces draws from a state tensor
    (:class:`TensorGenerator`) and in-place updates of a tensor, where a generator would break
    the graph and an int would be baked into it (one recompilation per call). They are plain
    attributes, not buffers: ``.to(device)`` leaves them on the CPU, where the draws are made.
    ``seed=None`` draws the seed from the global RNG (see :func:`resolve_seed`).
    """

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale)
        self._seed = resolve_seed(seed)
        self._seed_state = TensorGenerator.seeded(self._seed)
        self._rng = self._seed_state.clone()
        self._calls = torch.zeros((), dtype=torch.int64)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """:meth:`AttentionMethod.forward`, counting training-mode calls in ``_calls``."""
        out = super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **kwargs)
        if self.training:
            self._calls.add_(1)
        return out

    def _train_generator(self, when: Tensor | None = None) -> TensorGenerator:
        """The module's generator: its draws advance the module's random state."""
        return TensorGenerator(self._rng, when)

    def _eval_generator(self) -> TensorGenerator:
        """A generator restarted at the module's seed: the same draws on every call."""
        return TensorGenerator(self._seed_state.clone())

    def _call_generator(self) -> TensorGenerator:
        """The generator for this call's draws: fresh ones in training mode, fixed in eval."""
        return self._train_generator() if self.training else self._eval_generator()

    def get_extra_state(self) -> dict[str, Any]:
        """Generator state (uint8 tensor), seed and call count: plain data, so a state_dict
        holding it loads with ``torch.load(weights_only=True)``."""
        return {"generator": self._rng.clone(), "seed": self._seed, "calls": int(self._calls)}

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved."""
        keys = {"generator", "seed", "calls"}
        if (not isinstance(state, dict) or set(state) != keys
                or not isinstance(state["generator"], Tensor)):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{self.spec.name}: extra state must be the dict of get_extra_state() with keys "
                f"{sorted(keys)} (generator a uint8 tensor), got {got}"
            )
        # Through a generator: it validates the state as torch.Generator.set_state does.
        self._rng.copy_(torch.Generator().set_state(state["generator"].cpu()).get_state())
        self._seed = int(state["seed"])
        self._seed_state = TensorGenerator.seeded(self._seed)
        self._calls.fill_(int(state["calls"]))
