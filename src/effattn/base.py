"""The module every mechanism derives from: input validation and capability checks in one place.

Subclasses implement ``_attend`` (and ``_step`` when ``spec.decoding``); :meth:`forward`,
:meth:`step` and :meth:`prefill` validate the inputs against the contract first (shapes, dtypes,
the capabilities of the spec, the call inputs it declares), so a method's own code only ever sees
well-formed tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from effattn.registry import CallInput, MethodSpec


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
    Shapes, dtypes and devices are always checked, without reading a value; NaN/inf only in
    eager mode (not while ``torch.compiler.is_compiling()``), by one host sync for the three
    tensors: whether q.sum(), k.sum() and v.sum() (each in at least fp32) are all finite, one
    flag read back to the host. Only when it is not are q, k, v read one by one, to name the
    one holding a NaN or inf (an overflowing sum of finite values is not an error). On a GPU
    every read stalls the queue of launches: one per call, not one per tensor. A module's
    forward, ``step`` and ``prefill`` fold their call inputs' checks into the same read.
    """
    _check_qkv_layout(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    _check_values([("q", q, None), ("k", k, None), ("v", v, None)])


def _check_qkv_layout(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
) -> None:
    """The checks of :func:`check_qkv` that read no value: types, shapes, dtypes, devices."""
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


# A tensor whose values are checked: its name in the error, the tensor, and the closed interval
# its values must lie in (None: finite is enough).
ValueCheck = tuple[str, Tensor, tuple[float, float] | None]


def _check_values(checks: list[ValueCheck]) -> None:
    """Raise ``ValueError`` naming the first tensor of ``checks`` that holds a NaN or inf, or a
    value outside its bounds; eager only (under torch.compile, nothing).

    One host sync for all of them: each check is reduced to a 0-d flag on the device (an
    unbounded tensor by its sum, a bounded one elementwise), and the flags are read back
    together. Only when that read fails are the tensors read one by one, to find the culprit.
    Inside the forward call of a module whose engine reads the flag itself
    (:attr:`AttentionMethod.engine_reads_values`), the flag is formed here and read later, by
    :func:`read_deferred_values`.
    """
    if torch.compiler.is_compiling():
        # Reading values is a host sync, and a graph break under torch.compile: compiled
        # callers get the shape and dtype checks, eager ones these too.
        return
    # The sums in at least fp32: a half-precision sum of finite values overflows easily, and
    # would send every call down the elementwise reads below. One isfinite over all the sums:
    # each check is a few launches on a GPU.
    sums = [t.sum(dtype=compute_dtype(t.dtype)) for _, t, bounds in checks if bounds is None]
    flags = [_within(t, bounds).all() for _, t, bounds in checks if bounds is not None]
    if sums:
        flags.append(torch.isfinite(torch.stack(sums)).all())
    flag = flags[0] if len(flags) == 1 else torch.stack(flags).all()
    pending = _deferred.get()
    if pending is not None and not pending:
        pending.append((flag, checks))
        return
    _read_values(flag, checks)


def _read_values(flag: Tensor, checks: list[ValueCheck]) -> None:
    """The host's read of the value check's ``flag``, then, where it fails, of ``checks`` one
    by one to name the culprit."""
    if bool(flag):
        return
    for name, t, bounds in checks:
        if bounds is None:
            if not torch.isfinite(t).all():
                raise ValueError(f"{name} contains NaN or inf (shape {tuple(t.shape)})")
        elif not _within(t, bounds).all():
            low, high = bounds
            raise ValueError(f"{name} values must lie in [{low:g}, {high:g}]")


# The value check of the forward call in progress whose engine reads it (one (flag, checks)
# entry until read; an empty list while the call awaits it; None outside such a call).
_deferred: ContextVar[list[tuple[Tensor, list[ValueCheck]]] | None] = ContextVar(
    "effattn_deferred_values", default=None)


def read_deferred_values() -> None:
    """Read the value check that the forward call in progress deferred, raising its
    ``ValueError``; nothing outside such a call, or once read.

    An engine calls it after its host-side preparation and right before it launches its
    kernels: a host sync waits for everything launched before it, so that the GPU idles for
    whatever the host does between the read and the next launch. Read at the value check
    (first), the sync puts the whole preparation of a call (pieces, cached masks, compiled
    functions' guards) between the previous call's kernels and this one's; read here, that
    preparation overlaps the previous kernels. The inputs are not touched by anything launched
    before the read, so a call with a NaN raises exactly as before.
    """
    if torch.compiler.is_compiling():
        return  # nothing is deferred in a compiled call (no value check), nor traceable here
    pending = _deferred.get()
    if pending:
        _read_values(*pending.pop())


@contextmanager
def _values_read_by_engine() -> Iterator[None]:
    """The scope of an eager forward call whose value check waits for the engine's
    :func:`read_deferred_values`, and is read at the end if the engine did not (a path that
    launches no kernel of its own). If anything fails before, the deferred check is read
    first, so that a bad input raises its own ``ValueError`` rather than whatever it caused."""
    token = _deferred.set([])
    try:
        try:
            yield
        except BaseException:
            read_deferred_values()
            raise
        read_deferred_values()
    finally:
        _deferred.reset(token)


def _within(t: Tensor, bounds: tuple[float, float]) -> Tensor:
    """Elementwise: finite and in the closed interval ``bounds`` (False at a NaN)."""
    return torch.isfinite(t) & (t >= bounds[0]) & (t <= bounds[1])


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
    # Whether the engine of a forward call reads its value check itself, right before its
    # kernels (:func:`read_deferred_values`): for methods with no per-call state, since a
    # forward that raises must leave the module as it was, and the call's preparation then
    # runs before the read.
    engine_reads_values: ClassVar[bool] = False

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

    @property
    def call_inputs(self) -> tuple[CallInput, ...]:
        """The call inputs this module takes: those of its spec whose ``enabled_by`` option is on
        (a module keeps each such option as the attribute of that name), and the optional ones."""
        return tuple(c for c in self.spec.call_inputs
                     if c.enabled_by is None or getattr(self, c.enabled_by))

    def validate(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **call: Tensor | int | None,
    ) -> None:
        """Check a forward call against the contract, as :meth:`forward` does before computing.

        ``ValueError`` naming the argument for bad q (B, H, N, D), k (B, H, M, D), v (B, H, M, Dv)
        or mask, for a capability the spec refuses (with its reason), for a length over
        ``max_len`` and for a call input that is missing, not enabled, of the wrong shape or out
        of bounds; ``TypeError`` for a keyword the spec does not declare in ``call_inputs``.
        Wrappers that compute the attention themselves (``effattn.distributed``) call it first.
        The values (NaN/inf in q, k, v and the call inputs, their bounds) are checked last, in
        eager mode, by one host sync (see :func:`check_qkv`).
        """
        _check_qkv_layout(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
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
        self._check_call(call, q, k, v, causal)
        self._check_input_values(call, q, k, v)

    def _check_input_values(
        self, call: dict[str, Tensor | int | None], q: Tensor, k: Tensor, v: Tensor
    ) -> None:
        """NaN/inf in q, k, v and the tensor call inputs given, and the bounds of those that
        have some, in one host sync (:func:`_check_values`); after :meth:`_check_call`, which
        leaves only the inputs this module takes in ``call``."""
        inputs = [(c.name, call[c.name], c.bounds) for c in self.spec.call_inputs
                  if c.kind == "tensor" and call.get(c.name) is not None]
        _check_values([("q", q, None), ("k", k, None), ("v", v, None), *inputs])

    def _check_call(
        self, call: dict[str, Tensor | int | None], q: Tensor, k: Tensor, v: Tensor, causal: bool
    ) -> None:
        """The call inputs of ``call`` against the spec's ``call_inputs`` (see :meth:`validate`),
        all but their values (:meth:`_check_input_values`)."""
        if not call and not self.spec.call_inputs:
            return  # the common case, kept cheap: step runs this once per decoded token
        declared = {c.name: c for c in self.spec.call_inputs}
        unknown = sorted(set(call) - set(declared))
        if unknown:
            raise TypeError(
                f"{self.spec.name} got unexpected call argument(s) {', '.join(unknown)}; its call "
                f"inputs are: {', '.join(declared) or 'none'}"
            )
        taken = self.call_inputs
        dims = {"B": q.shape[0], "H": q.shape[1], "N": q.shape[2], "M": k.shape[2],
                "D": q.shape[3], "Dv": v.shape[3]}
        for c in self.spec.call_inputs:
            value = call.get(c.name)
            shape = f"({', '.join(c.shape)})"
            if c not in taken:
                if value is not None:
                    raise ValueError(f"{self.spec.name}: {c.name} is only taken with "
                                     f"{c.enabled_by}=True")
                continue
            if value is None:
                if c.required:
                    raise ValueError(f"{self.spec.name} with {c.enabled_by}=True needs "
                                     f"{c.name} {shape} in the call")
                continue
            if c.causal_only and not causal:
                given = f"{c.name}={value}" if c.kind == "int" else f"{c.enabled_by}=True"
                raise ValueError(f"{self.spec.name} with {given} needs causal=True: "
                                 f"{c.name} is defined for causal attention only")
            if c.kind == "int":
                _check_int_input(c, value)
                continue
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise ValueError(f"{c.name} must be a floating-point tensor, got "
                                 f"{getattr(value, 'dtype', type(value).__name__)}")
            expected = c.expected_shape(dims)
            if tuple(value.shape) != expected:
                raise ValueError(f"{c.name} must be {shape} = {expected}, "
                                 f"got {tuple(value.shape)}")
            if value.device != q.device:
                raise ValueError(f"{c.name} is on {value.device}, q on {q.device}")

    def prepare_call(self) -> None:
        """Advance the module's per-call state, once per forward call, before computing.

        Nothing here; :class:`effattn.random.RandomizedAttention` counts training-mode calls
        and kernelized methods redraw their random features when the schedule says so. A wrapper
        that computes the attention itself instead of calling :meth:`forward`
        (``effattn.distributed``) calls it after :meth:`validate`, so that the module's random
        state moves exactly as a forward call would move it.
        """

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **call: Tensor | int | None,
    ) -> Tensor:
        """Attention of q (B, H, N, D) over k (B, H, M, D), v (B, H, M, Dv) -> (B, H, N, Dv).

        ``call``: the call inputs the spec declares (``spec.call_inputs``), by name.
        """
        if self.engine_reads_values and not torch.compiler.is_compiling():
            with _values_read_by_engine():
                return self._forward(q, k, v, causal, key_padding_mask, call)
        return self._forward(q, k, v, causal, key_padding_mask, call)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool,
                 key_padding_mask: Tensor | None, call: dict[str, Tensor | int | None]) -> Tensor:
        self.validate(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **call)
        self.prepare_call()
        out = self._attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                           **_given(call))
        return out.to(q.dtype)

    def _check_decoding(self, q: Tensor, k: Tensor, v: Tensor, what: str) -> None:
        if not self.spec.decoding:
            self._refuse("decoding", f"recurrent decoding ({what})")
        _check_qkv_layout(q, k, v, causal=True, key_padding_mask=None)
        if q.shape[1] != self.heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"q has shape {tuple(q.shape)}, the module was built with heads={self.heads}, "
                f"head_dim={self.head_dim}"
            )

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, state: Any = None, **call: Tensor | int | None
    ) -> tuple[Tensor, Any]:
        """One decoding step: q, k, v of shape (B, H, 1, D); returns (out (B, H, 1, Dv), state).

        Feeding a sequence one token at a time from ``state=None`` gives the causal forward;
        ``call`` holds the call inputs at this token (N = 1 in their shapes).
        """
        if q.shape[2:3] != (1,) or k.shape[2:3] != (1,):
            raise ValueError(
                f"step takes one token: q, k, v must be (B, H, 1, D), got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}"
            )
        self._check_decoding(q, k, v, "step")
        self._check_call(call, q, k, v, causal=True)
        self._check_input_values(call, q, k, v)
        out, state = self._step(q, k, v, state, **_given(call))
        return out.to(q.dtype), state

    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, state: Any = None, **call: Tensor | int | None
    ) -> tuple[Tensor, Any]:
        """Causal attention over a block of L tokens that continues ``state`` (None: the start).

        q, k, v: (B, H, L, D); returns (out (B, H, L, Dv), state after the block). The parallel
        form of L calls to :meth:`step`: a prompt is prefilled in one call, then decoded.
        """
        self._check_decoding(q, k, v, "prefill")
        self._check_call(call, q, k, v, causal=True)
        self._check_input_values(call, q, k, v)
        out, state = self._prefill(q, k, v, state, **_given(call))
        return out.to(q.dtype), state

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Any:
        """Prepare k (B, H, M, D), v (B, H, M, Dv) for :meth:`attend_memory`, once.

        For a decoder's cross-attention: every step attends to the same source. The generic
        memory keeps k and v (each read costs O(M)); kernelized methods fold them into the
        fixed-size state [S, z] = φ(K)^T [V, 1], so that each read costs O(F Dv) whatever M is.
        """
        _check_qkv_layout(k[:, :, :1], k, v, causal=False, key_padding_mask=key_padding_mask)
        self._check_heads(k)
        if not self.spec.cross:
            self._refuse("cross", "cross-attention over a memory")
        _check_values([("k", k, None), ("v", v, None)])
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
        **call: Tensor,
    ) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _attend")

    def _step(
        self, q: Tensor, k: Tensor, v: Tensor, state: Any, **call: Tensor
    ) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement _step")

    def _prefill(
        self, q: Tensor, k: Tensor, v: Tensor, state: Any, **call: Tensor
    ) -> tuple[Tensor, Any]:
        """One :meth:`_step` per token, each call input cut at the token along its N;
        methods with a parallel causal form override this."""
        along = {c.name: c.shape.index("N") for c in self.spec.call_inputs if "N" in c.shape}
        outs = []
        for t in range(q.shape[2]):
            one = slice(t, t + 1)
            at = {name: x.narrow(along[name], t, 1) if name in along else x
                  for name, x in call.items()}
            out, state = self._step(q[:, :, one], k[:, :, one], v[:, :, one], state, **at)
            outs.append(out)
        return torch.cat(outs, 2), state


def _check_int_input(c: CallInput, value: Any) -> None:
    """An int call input: a Python int (no bool, no tensor) within ``c.bounds``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{c.name} must be an int, got {value!r}")
    if c.bounds is not None and not c.bounds[0] <= value <= c.bounds[1]:
        raise ValueError(f"{c.name} must lie in [{c.bounds[0]:g}, {c.bounds[1]:g}], got {value}")


def _given(call: dict[str, Tensor | int | None]) -> dict[str, Tensor | int]:
    """The call inputs actually given: a mechanism's code sees no None for an absent one."""
    return {name: value for name, value in call.items() if value is not None}
