"""The base class of the kernelized methods: features -> core, redraw policy, recurrent step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from effattn.base import check_bool, check_positive_int, compute_dtype
from effattn.kernelized.core import (
    SLICE_ELEMENTS,
    CoreConfig,
    DenominatorUnderflowError,
    FeatureFn,
    RecurrentState,
    promotes_inside,
)
from effattn.kernelized.features import AffineExponents, Features
from effattn.kernelized.hybrid import WindowState, hybrid_attention, hybrid_prefill, hybrid_step
from effattn.random import RandomizedAttention, TensorGenerator

# The options of the window hybrid (effattn.kernelized.hybrid), which every kernelized method
# takes: exact softmax over a window of ``window`` keys (None: the pure method), and a learned
# per-head factor on the kernelized part (``window_factor``).
WINDOW_OPTIONS = {"window": None, "window_factor": False}


class KernelizedAttention(RandomizedAttention):
    """Base of kernelized methods: subclasses define :meth:`features` (and random draws).

    Random features are drawn from the module generator (see :class:`RandomizedAttention`, which
    saves it with the state_dict) and redrawn in training mode every ``redraw_interval`` forward
    calls (None: never); never in eval mode or in ``step``. Subclasses name their random buffers in
    ``random_buffers`` and draw them in :meth:`_draw`.
    ``chunk_size`` is the C of the causal chunkwise form. Inputs in fp16/bf16 are computed in
    fp32; the output comes back in the input dtype. Forward, prefill and memory reads raise a
    ValueError where non-negative features underflow to a zero denominator for a query that
    sees keys (eager only; ``step`` does not check: it would cost a host sync per token).
    The core takes a gate (B, H, N) in [0, 1] (gated attention, a causal recurrence): a method
    that declares the call input ``gate`` in its spec gets it in ``_attend``, ``_step`` and
    ``_prefill``.

    ``window=W`` makes it the window hybrid of :mod:`effattn.kernelized.hybrid`: exact softmax
    over each query's last W keys (non-causal: |i - j| <= W // 2) and the feature-map estimate
    over the others, in one normaliser; decoding keeps a W-key ring buffer beside the state;
    queries and keys must be aligned (no cross-attention). ``window_factor`` adds a learned
    per-head factor α_h = exp(window_log_factor_h) (initially 1) on the estimate.
    """

    # Buffers of random features that redraw() replaces with _draw()'s values.
    random_buffers: tuple[str, ...] = ()
    # Feature values per slice of the sequence (see kernelized.core); tests shrink it.
    slice_elements: int = SLICE_ELEMENTS

    def __init__(
        self,
        head_dim: int,
        heads: int,
        max_len: int | None = None,
        seed: int | None = None,
        scale: float | None = None,
        *,
        redraw_interval: int | None = None,
        chunk_size: int = 32,
        eps: float = 1e-6,
        window: int | None = None,
        window_factor: bool = False,
    ) -> None:
        super().__init__(head_dim, heads, max_len, seed, scale)
        if redraw_interval is not None:
            check_positive_int("redraw_interval", redraw_interval)
        self.redraw_interval = redraw_interval
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.eps = eps
        self.window = None if window is None else check_positive_int("window", window)
        if check_bool("window_factor", window_factor) and window is None:
            raise ValueError("window_factor=True needs a window: it weighs the estimate beside "
                             "the window's exact softmax")
        self.window_factor = window_factor
        self.window_log_factor = nn.Parameter(torch.zeros(heads)) if window_factor else None

    def extra_repr(self) -> str:
        if self.window is None:
            return super().extra_repr()
        return (f"{super().extra_repr()}, window={self.window}, "
                f"window_factor={self.window_factor}")

    def window_logits(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, float, Tensor | None]:
        """What the window's exact softmax is taken of: (q', k', scale, shift) with logits
        ``scale q'·k' + shift`` (shift (H,) or None), the log of the kernel the features
        estimate: ``scale q·k`` here; RFA's Gaussian kernel overrides it."""
        return q, k, self.scale, None

    def _refuse_window(self, what: str) -> None:
        if self.window is not None:
            raise ValueError(f"{self.spec.name} with window={self.window} cannot do {what}: the "
                             "window needs aligned query and key positions (N == M)")

    @property
    def estimates_exp(self) -> bool:
        """Whether the kernel is an unbiased estimate of exp of :meth:`window_logits`
        (``features.UNBIASED_EXP``): then a window hybrid's estimate needs no factor of its own,
        and conversion leaves its factor at 1."""
        return False

    @property
    def feature_dim(self) -> int:
        """F of φ(x), the width of the state (B, H, F, Dv + 1)."""
        raise NotImplementedError

    def features(self, x: Tensor, *, is_query: bool) -> Features:
        """φ of queries or keys in the core's convention (see kernelized.features)."""
        raise NotImplementedError

    def feature_tensors(self) -> tuple[Tensor, ...]:
        """The tensors :meth:`features` reads: the module's parameters and buffers. The core's
        recomputing backward takes them as inputs, so that the trainable ones get their
        gradients and a redraw between forward and backward raises (see kernelized.core)."""
        return (*self.parameters(), *self.buffers())

    def core(self) -> CoreConfig:
        """The core's settings for one call: every caller (this module, the window hybrid,
        sequence parallelism) passes them whole."""
        return CoreConfig(self.feature_fn(), self.feature_dim, self.chunk_size, self.eps,
                          self.slice_elements, self.feature_tensors(), self.exponent_map())

    def feature_fn(self) -> FeatureFn:
        """The map the core calls: :meth:`features` by default. A map that a strategy can read
        as data is returned as such (performer's positive map,
        :class:`~effattn.kernelized.features.PositiveMap`, the trigonometric maps,
        :class:`~effattn.kernelized.features.SineMap`, the rectified ones,
        :class:`~effattn.kernelized.features.ReluMap`, Taylor's,
        :class:`~effattn.kernelized.features.TaylorMap`, and elu + 1,
        :class:`~effattn.kernelized.features.EluMap`, which the triton strategy forms inside
        its kernels), computing exactly what :meth:`features` does."""
        return self.features

    def exponent_map(self) -> Callable[[Tensor], Tensor] | None:
        """A map whose features are exp of per-feature exponents returns its exponents function
        here (x -> u, φ = exp(u)): the core then runs its per-feature stabiliser
        (:mod:`effattn.kernelized.exponents`). None (the default): the row convention of
        :meth:`features`."""
        return None

    def _draw(self, generator: TensorGenerator) -> tuple[Tensor, ...]:
        """Fresh values of the buffers named in ``random_buffers``, in that order."""
        return ()

    def redraw(self) -> None:
        """Draw fresh random features from the module's generator (no-op for deterministic maps)."""
        self._redraw(None)

    def _redraw(self, when: Tensor | None) -> None:
        """Redraw the random buffers; only where ``when`` (0-d bool) is True, when given."""
        for name, value in zip(self.random_buffers, self._draw(self._train_generator(when)),
                               strict=True):
            buf = getattr(self, name)
            if when is not None:
                value = torch.where(when.to(buf.device), value.to(buf), buf)
            buf.copy_(value)

    def prepare_call(self) -> None:
        """Redraw the random features when the schedule says so, then count the call."""
        self._maybe_redraw()
        super().prepare_call()

    def _maybe_redraw(self) -> None:
        interval = self.redraw_interval
        if not self.training or interval is None or not self.random_buffers:
            return
        # _calls counts the training calls before this one: calls interval + 1, 2 interval + 1,
        # ... start with a redraw.
        due = (self._calls > 0) & (self._calls % interval == 0)
        if torch.compiler.is_compiling():
            # The schedule is data, not a branch (one on the counter would recompile every call):
            # every call draws under ``due`` (zeros, generator untouched, when not due) and
            # selects, paying the draw's arithmetic (the QR of orthogonal features) each time.
            self._redraw(due)
        elif bool(due):  # a CPU tensor: no device sync
            self._redraw(None)

    def _underflow(self, err: DenominatorUnderflowError, q: Tensor, k: Tensor | None) -> ValueError:
        """The core's underflow error, with the method and, given k, a bound on the logits."""
        bound = ""
        if k is not None:
            # Cauchy-Schwarz, per (batch, head): |scale q_i·k_j| <= scale |q_i| |k_j|.
            top = (q.norm(dim=-1).amax(-1) * k.norm(dim=-1).amax(-1)).amax().item()
            bound = f" (|scale q·k| <= scale |q| |k| up to {self.scale * top:.3g})"
        return ValueError(
            f"{self.spec.name}: {err}{bound}; compute in float64 or scale q, k down"
        )

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        key_padding_mask: Tensor | None,
        gate: Tensor | None = None,
    ) -> Tensor:
        dt = compute_dtype(q.dtype)
        if self.window is not None:
            if q.shape[2] != k.shape[2]:
                self._refuse_window(f"cross-attention (N={q.shape[2]} != M={k.shape[2]})")
            try:
                return hybrid_attention(self, q.to(dt), k.to(dt), v.to(dt), causal=causal,
                                        key_padding_mask=key_padding_mask,
                                        gate=None if gate is None else gate.to(dt))
            except DenominatorUnderflowError as err:
                raise self._underflow(err, q, k) from None
        config = self.core()
        # A map the triton strategy forms inside its kernels takes half precision as it is.
        formed = config.exponents is None or isinstance(config.exponents, AffineExponents)
        if not (causal and formed and promotes_inside(q)):
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
            gate = None if gate is None else gate.to(dt)
        # Else the strategy promotes slice by slice: no fp32 copies of q, k, v are held.
        try:
            return config.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                    gate=gate)
        except DenominatorUnderflowError as err:
            raise self._underflow(err, q, k) from None

    def _memory(
        self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None
    ) -> RecurrentState:
        self._refuse_window("cross-attention over a memory")
        dt = compute_dtype(k.dtype)
        return self.core().key_state(k.to(dt), v.to(dt), key_padding_mask=key_padding_mask)

    def _attend_memory(self, q: Tensor, memory: RecurrentState) -> Tensor:
        expected = (q.shape[0], self.heads, self.feature_dim)
        if not isinstance(memory, RecurrentState) or memory.kv.shape[:3] != expected:
            got = (tuple(memory.kv.shape) if isinstance(memory, RecurrentState)
                   else type(memory).__name__)
            raise ValueError(
                f"memory must be {self.spec.name}.memory() of a (B={q.shape[0]}, H={self.heads}) "
                f"source: a state of shape ({', '.join(map(str, expected))}, Dv + 1), got {got}"
            )
        try:
            return self.core().read_queries(q.to(compute_dtype(q.dtype)), memory)
        except DenominatorUnderflowError as err:
            raise self._underflow(err, q, None) from None

    def _step(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: RecurrentState | WindowState | None,
        gate: Tensor | None = None,
    ) -> tuple[Tensor, RecurrentState | WindowState]:
        dt = compute_dtype(q.dtype)
        if self.window is not None:
            return hybrid_step(self, q.to(dt), k.to(dt), v.to(dt), state,
                               None if gate is None else gate.to(dt))
        return self.core().step(q.to(dt), k.to(dt), v.to(dt), state,
                                gate=None if gate is None else gate.to(dt))

    def _prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: RecurrentState | WindowState | None,
        gate: Tensor | None = None,
    ) -> tuple[Tensor, RecurrentState | WindowState]:
        dt = compute_dtype(q.dtype)
        try:
            if self.window is not None:
                return hybrid_prefill(self, q.to(dt), k.to(dt), v.to(dt), state,
                                      None if gate is None else gate.to(dt))
            return self.core().causal(q.to(dt), k.to(dt), v.to(dt), state,
                                      gate=None if gate is None else gate.to(dt))
        except DenominatorUnderflowError as err:
            raise self._underflow(err, q, k) from None
