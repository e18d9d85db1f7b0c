"""The causal core's ``lag`` (CoreConfig.causal / causal_normalised): query i sees keys
j <= i - lag, the keys a window of ``lag`` leaves to the window hybrid's kernelized part.

Against the dense reference (effattn.naive.kernel_attention with ``lag``) in float64 with
gradients, on N = 63 with chunks that do not divide it, several slices, the keys' log-scales,
padding and the gate, on both strategies of the kernelized engine; the normaliser against the
reference's denominator; lag 0 is the plain causal form; the errors.
"""

import math

import pytest
import torch

from effattn import naive as R
from effattn import strategy
from effattn.kernelized.core import CoreConfig

B, H, N, F, DV = 2, 3, 63, 10, 5
LAGS = [0, 1, 5, N - 1, N]


def _features(x, *, is_query):
    """Precomputed features: keys travel as [φ(K), log-scale], queries as φ(Q)."""
    return (x, None) if is_query else (x[..., :-1], x[..., -1:])


def _config(chunk):
    # slice_elements: a few slices of the sequence, so that the state crosses slices.
    return CoreConfig(_features, F, chunk_size=chunk, eps=1e-6, slice_elements=800)


def _inputs():
    g = torch.Generator().manual_seed(0)
    phi_q = torch.rand(B, H, N, F, generator=g, dtype=torch.float64)
    phi_k = torch.rand(B, H, N, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, DV, generator=g, dtype=torch.float64)
    log_scale = 3 * torch.randn(B, H, N, 1, generator=g, dtype=torch.float64)
    gate = 0.3 + 0.7 * torch.rand(B, H, N, generator=g, dtype=torch.float64)
    return [t.requires_grad_(True) for t in (phi_q, phi_k, v, log_scale, gate)]


def _padding():
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0, :9] = True
    mask[1, -13:] = True
    return mask


@pytest.mark.parametrize("kernelized", ["cpu", "gpu"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk", [8, 10])
@pytest.mark.parametrize("lag", LAGS)
def test_lag_matches_the_reference_with_gradients(lag, chunk, padded, gated, kernelized):
    phi_q, phi_k, v, ls, gate = inputs = _inputs()
    mask = _padding() if padded else None
    with strategy.force(kernelized=kernelized):
        out, state, norm = _config(chunk).causal_normalised(
            phi_q, torch.cat([phi_k, ls], -1), v, key_padding_mask=mask,
            gate=gate if gated else None, lag=lag,
        )
    ref = R.kernel_attention(phi_q, phi_k, v, key_log_scale=ls, key_padding_mask=mask,
                             causal=True, gate=gate if gated else None, lag=lag)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    weights = R.kernel_weights(N, N, causal=True, key_padding_mask=mask,
                               gate=gate if gated else None, lag=lag)
    den = ((phi_q @ (phi_k * ls.exp()).transpose(-2, -1)) * weights).sum(-1)
    seen = weights.sum(-1).expand_as(den) > 0
    assert torch.equal(torch.isfinite(norm.log_abs), seen)
    assert torch.equal(norm.sign, seen.to(norm.sign.dtype))
    torch.testing.assert_close(norm.log_abs[seen], den[seen].log(), rtol=1e-10, atol=1e-10)
    assert state.position == max(N - lag, 0)
    if lag >= N:  # no query sees a key: nothing to differentiate
        assert not out.requires_grad and not out.any()
        return
    probe = torch.randn_like(out)
    loss = (out * probe).sum() + norm.log_abs[seen].sum()
    loss_ref = (ref * probe).sum() + den[seen].log().sum()
    used = inputs if gated else inputs[:4]
    for a, b in zip(torch.autograd.grad(loss, used), torch.autograd.grad(loss_ref, used),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kernelized", ["cpu", "gpu"])
def test_lag_zero_is_the_causal_form_and_the_state_holds_the_seen_keys(kernelized):
    phi_q, phi_k, v, ls, _ = _inputs()
    k = torch.cat([phi_k, ls], -1)
    config = _config(8)
    with strategy.force(kernelized=kernelized), torch.no_grad():
        plain, plain_state = config.causal(phi_q, k, v)
        zero, zero_state = config.causal(phi_q, k, v, lag=0)
        _, lagged_state = config.causal(phi_q, k, v, lag=5)
        _, first_state = config.causal(phi_q[:, :, :N - 5], k[:, :, :N - 5], v[:, :, :N - 5])
    assert torch.equal(plain, zero) and torch.equal(plain_state.kv, zero_state.kv)
    torch.testing.assert_close(lagged_state.kv * lagged_state.log_scale.exp(),
                               first_state.kv * first_state.log_scale.exp(), rtol=1e-12,
                               atol=1e-12)


def test_lag_errors_name_the_argument():
    phi_q, phi_k, v, ls, _ = _inputs()
    k = torch.cat([phi_k, ls], -1)
    config = _config(8)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lag"):
            config.causal(phi_q, k, v, lag=bad)
    _, state = config.causal(phi_q, k, v)
    with pytest.raises(ValueError, match="lag"):
        config.causal(phi_q, k, v, state, lag=1)
    assert math.isinf(float(config.causal_normalised(phi_q, k, v, lag=N)[2].log_abs.max()))
