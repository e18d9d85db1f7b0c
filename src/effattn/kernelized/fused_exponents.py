"""The ``triton`` strategy of the per-feature core (:mod:`effattn.kernelized.exponents`): the
causal scan of Hedgehog's exp map in fused Triton kernels
(:mod:`effattn.kernelized.fused_exponents_kernels`), the exponents formed inside them.

The GPU strategy's form (:mod:`effattn.kernelized.exponents_gpu`) holds a slice's exponents,
its chunk states and float64 in-chunk factors, and its backward recomputes spans under
autograd through the map: at 65536 tokens in bf16 (B = 1, H = 8, D = 64, 128 features) a
training step holds 1.4 GiB over its inputs, SDPA 0.3. Here, as in the row core's triton
strategy (:mod:`effattn.kernelized.fused`), the kernels read q, k (N x D, in their own dtype:
half precision needs no promoted copy) and the heads' rows of the map
(:class:`~effattn.kernelized.features.AffineExponents`) in place of u (N x F), walk the chunks
with the state in registers and write the outputs, the queries' shifts c_i and the running
maxima per chunk; the backward kernels return the gradients of q, k and of the rows and offsets
themselves, so that nothing of size N x F is held, forward or backward.

What it runs: causal, eager, for an :class:`~effattn.kernelized.features.AffineExponents` map
(with key padding, an entering state, and the normaliser of the window hybrid). Everything else
of the per-feature core under this strategy (other exponent functions, calls traced by
``torch.compile``; non-causal, cross-attention and decoding, already batched GEMMs) is the GPU
strategy's. Training keeps q, k, v, the output and per slice the entering state, checkpoint
states every S_b tokens (:func:`effattn.kernelized.fused.backward_span_tokens`), the shifts,
the denominators and the running maxima ((N / C) F values); the backward runs span by span.

Shapes: B batch, H heads, N tokens, D head dim, F features (2 F' for F' projections), Dv value
dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from effattn.base import compute_dtype
from effattn.kernelized import core, fused, gpu
from effattn.kernelized import exponents as ex
from effattn.kernelized import features as fm
from effattn.kernelized.core import Normaliser, RecurrentState


def takes(exponents: Any) -> bool:
    """Whether the kernels form this exponents function themselves (an
    :class:`~effattn.kernelized.features.AffineExponents`)."""
    return isinstance(exponents, fm.AffineExponents)


def _kernels() -> Any:
    """:mod:`effattn.kernelized.fused_exponents_kernels`, imported at the first use (it imports
    triton), with the row strategy's checks: triton present, tensors it can run."""
    fused._kernels()
    from effattn.kernelized import fused_exponents_kernels

    return fused_exponents_kernels


def causal(q: Tensor, k: Tensor, v: Tensor, exponents: fm.AffineExponents, feature_dim: int,
           state: RecurrentState | None = None, *, key_padding_mask: Tensor | None = None,
           chunk_size: int = 32, slice_elements: int = 1 << 20, normaliser: bool = False,
           feature_tensors: Sequence[Tensor] | None = None,
           ) -> tuple[Tensor, RecurrentState, Normaliser | None]:
    """:func:`effattn.kernelized.exponents.causal` (same arguments, outputs and state; its
    shape check and ``lag`` are handled there) in the fused kernels: q, k (B, H, N, D) and v
    (B, H, N, Dv) in any floating dtype, read as they are (half precision computed in fp32) ->
    the output (B, H, N, Dv) in q's dtype, the state after (log-scales (B, H, F, 1)) and, with
    ``normaliser``, the queries' normalisers. Slices of the GPU strategy's size
    (:func:`effattn.kernelized.gpu.slice_tokens`).

    Raises RuntimeError where triton is missing or, on CPU tensors, not interpreting."""
    dt = compute_dtype(q.dtype)
    if torch.compiler.is_compiling():
        from effattn.kernelized import exponents_gpu

        return exponents_gpu.causal(q.to(dt), k.to(dt), v.to(dt), exponents, feature_dim, state,
                                    key_padding_mask=key_padding_mask, chunk_size=chunk_size,
                                    slice_elements=slice_elements, normaliser=normaliser)
    _kernels()
    if not fused.runs(q):
        raise RuntimeError(
            "the kernelized engine's triton strategy runs CUDA tensors, or CPU tensors under "
            "Triton's interpreter (TRITON_INTERPRET=1 before effattn's kernels are imported); "
            f"got tensors on {q.device}"
        )
    b, h, n = q.shape[:3]
    dv = v.shape[-1]
    given = state
    state = ex._state(state, b, h, feature_dim, dv, q.new_empty(0, dtype=dt))
    step = gpu.slice_tokens(b * h, feature_dim, dv, chunk_size, slice_elements)
    if core._recording():
        tensors = ex._exponent_inputs(exponents, q, feature_tensors)
        kv = None if given is None else state.kv
        if core._needs_grad(q, k, v, kv, *tensors):
            back = fused.backward_span_tokens(b * h, feature_dim, dv, chunk_size,
                                              slice_elements, dt)
            out, kv, scale, log_abs, sign = _FusedExponents.apply(
                q, k, v, key_padding_mask, state.kv, state.log_scale, exponents, chunk_size,
                (step, back), normaliser, *tensors)
            return (out, RecurrentState(kv, scale, state.position + n),
                    Normaliser(log_abs, sign) if normaliser else None)
    out, kv, scale, norm, _ = _sliced(q, k, v, key_padding_mask, state.kv, state.log_scale,
                                      exponents, chunk_size, step, None, normaliser)
    return out, RecurrentState(kv, scale, state.position + n), norm


class _Slice:
    """What one slice's forward leaves for its backward: the entering state kv, the checkpoint
    states (B, H, n_marks, F, Dv + 1), the shifts c and denominators (B, H, n) and the running
    maxima R_{-1}..R_{nc-1} (B, H, nc + 1, F) (the checkpoints' scales among them)."""

    def __init__(self, kv: Tensor, marks: Tensor, shift: Tensor, den: Tensor,
                 running: Tensor) -> None:
        self.kv, self.marks, self.shift, self.den, self.running = kv, marks, shift, den, running


def _inputs(exponents: fm.AffineExponents, q: Tensor, k: Tensor, pad: Tensor | None,
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """What the kernels read: x̃ = q and k themselves (in their own dtype: the kernels convert
    their tiles), the keys' log-weights (B, H, n) (0, -inf at padded keys), and the heads'
    rows (H, F, D) and offsets (H, F) in the compute dtype, differentiable where grad mode is
    on."""
    dt = compute_dtype(q.dtype)
    w, bias = exponents.rows(dt)
    return q, k, fused._log_weights(None, pad, None, k, dt)[0], w, bias


def _forward_slice(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor,
                   scale: Tensor, exponents: fm.AffineExponents, chunk: int, back: int | None,
                   normaliser: bool,
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, _Slice]:
    """One slice from the state (kv, scale (B, H, F, 1)) before it: the output (B, H, n, Dv,
    in q's dtype), the state after (kv, scale), the normaliser's log and sign (None without
    ``normaliser``) and what its backward needs (checkpoints every ``back`` tokens)."""
    kernels = _kernels()
    xq, xk, ls, w, bias = _inputs(exponents, q, k, pad)
    xq, xk = xq.contiguous(), xk.contiguous()
    w, bias = w.contiguous(), bias.contiguous()
    num, den, kv_out, running, marks, shift = kernels.forward(
        xq, xk, ls, v.contiguous(), kv, scale[..., 0], w, bias, chunk, back)
    den = den[..., None]
    div = ex._divisors(den)[0]
    out = num.div_(div).to(q.dtype)
    log_abs = sign = None
    if normaliser:
        log_abs, sign = ex._normaliser(den, div, shift[..., None])
    dt = w.dtype
    return (out, kv_out.to(dt), running[:, :, -1, :, None].to(dt), log_abs, sign,
            _Slice(kv, marks, shift, den, running))


def _sliced(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor, scale: Tensor,
            exponents: fm.AffineExponents, chunk: int, step: int, back: int | None,
            normaliser: bool,
            ) -> tuple[Tensor, Tensor, Tensor, Normaliser | None, list[_Slice]]:
    """:func:`_forward_slice` slice after slice of ``step`` tokens, each handing its state to
    the next (each slice's output converted to q's dtype before the next slice's work, joined
    at the end, as the row core's triton strategy does)."""
    outs, logs, signs, slices = [], [], [], []
    for a, e in core._spans(q.shape[2], step):
        out, kv, scale, log_abs, sign, saved = _forward_slice(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None if pad is None else pad[:, a:e], kv,
            scale, exponents, chunk, back, normaliser)
        outs.append(out)
        logs.append(log_abs)
        signs.append(sign)
        slices.append(saved)
    norm = None
    if normaliser:
        norm = Normaliser(torch.cat(logs, 2), torch.cat(signs, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 2)), kv, scale, norm, slices


class _FusedExponents(torch.autograd.Function):
    """:func:`causal` in the fused kernels, keeping q, k, v, the output and per slice what
    :class:`_Slice` lists: O(N (D + Dv) + (N / C) F) between forward and backward, no
    exponents and no chunk state beyond the checkpoints.

    Backward, span by span of S_b tokens from the last
    (:func:`effattn.kernelized.core._backward_in_spans`): the rows recomputed under autograd
    (a dtype cast and the [W, -W] concatenation); the gradient of the denominators
    from the output's (:func:`effattn.kernelized.fused_kernels.divisor_grad`) and, for the
    hybrid, from the normaliser's log |d|; the backward kernels from the span's checkpoint for
    the gradients of x̃, v, the rows, the offsets and the entering state; then autograd on to
    q, k, W and b.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, kv: Tensor,
                scale: Tensor, exponents: fm.AffineExponents, chunk: int,
                steps: tuple[int, int], normaliser: bool, *tensors: Tensor) -> tuple[Tensor, ...]:
        step, back = steps
        out, kv_after, scale_after, norm, slices = _sliced(
            q, k, v, pad, kv, scale, exponents, chunk, step, back, normaliser)
        ctx.exponents, ctx.chunk, ctx.normaliser = exponents, chunk, normaliser
        # Each span: its tokens, and where its entering state is (slice, checkpoint or -1).
        ctx.spans, ctx.where = [], []
        for i, (a, e) in enumerate(core._spans(q.shape[2], step)):
            for j, start in enumerate(range(a, e, back)):
                ctx.spans.append((start, min(e, start + back)))
                ctx.where.append((i, a, j - 1))
        saved = [t for s in slices for t in (s.kv, s.marks, s.shift, s.den, s.running)]
        ctx.save_for_backward(q, k, v, pad, out, *saved, *tensors)
        if norm is None:
            norm = Normaliser(out.new_empty(0), out.new_empty(0))
        ctx.mark_non_differentiable(scale_after, norm.sign)
        return out, kv_after, scale_after, norm.log_abs, norm.sign

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_kv: Tensor | None, _: Tensor | None,
                 d_log_abs: Tensor | None, __: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, pad, out, *rest = ctx.saved_tensors
        slices = len({w[0] for w in ctx.where})
        saved, tensors = rest[:5 * slices], rest[5 * slices:]
        kernels = _kernels()
        chunk = fused._kernels().tile(ctx.chunk, compute_dtype(q.dtype))

        def span(i: int, leaves: list[Tensor | None],
                 d_after: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
            a, e = ctx.spans[i]
            s, start, mark = ctx.where[i]
            kv, marks, shift, den, running = saved[5 * s:5 * s + 5]
            if mark >= 0:
                kv = marks[:, :, mark]
            r0, r1 = a - start, e - start
            shift, den = shift[:, :, r0:r1].contiguous(), den[:, :, r0:r1]
            # The span's chunks' running maxima, the first its entering state's scale.
            running = running[:, :, r0 // chunk:-(-r1 // chunk) + 1].contiguous()
            q_s, k_s, v_s = leaves
            with torch.enable_grad():
                xq, xk, ls, w, bias = _inputs(ctx.exponents, q_s, k_s,
                                              None if pad is None else pad[:, a:e])
            div, back = ex._divisors(den)
            d_out_s = d_out[:, :, a:e]
            g_den = fused._kernels().divisor_grad(d_out_s, out[:, :, a:e], back[..., 0])
            if ctx.normaliser and d_log_abs is not None:
                # log |d| = log(den) + c: den receives d_log_abs / den where it is seen.
                g_den.sub_(d_log_abs[:, :, a:e] * back[..., 0])
            d_xq, d_xk, d_v, d_kv_in, d_w, d_b = kernels.backward(
                xq.detach().contiguous(), xk.detach().contiguous(), ls, v_s.detach().contiguous(),
                kv, running, shift, d_out_s, div[..., 0], g_den, d_after, w.detach().contiguous(),
                bias.detach().contiguous(), ctx.chunk)
            got = core._backprop(
                (xq, xk, w, bias),
                (d_xq.to(xq.dtype), d_xk.to(xk.dtype), d_w.to(w.dtype), d_b.to(bias.dtype)),
                [q_s, k_s, *tensors])
            d_values = d_v.to(v_s.dtype) if v_s.requires_grad else None
            return d_kv_in.to(kv.dtype), [got[0], got[1], d_values, *got[2:]]

        needs = ctx.needs_input_grad
        grads, d_kv, d_tensors = core._backward_in_spans(
            (q, k, v), needs[:3], ctx.spans, len(tensors), d_kv, span)
        # One gradient per input of forward: q, k, v, the mask, kv, scale, exponents, chunk,
        # steps, normaliser, then the exponents' tensors.
        return (*grads, None, d_kv if needs[4] else None, None, None, None, None, None,
                *d_tensors)
