"""The trigonometric feature maps (performer's ``trig``, RFA's ``sincos``) with and without
autograd: the same features either way, and less held outside autograd, where sin and cos are
written into place.

Every map's reference comparisons (outputs and gradients, every mode) run through the methods in
tests/test_references.py; this file checks the two paths of their shared helper."""

import pytest
import torch

from effattn.kernelized import features as fm
from effattn.tools.bench.accounting import live_peak_bytes

MAPS = {"trig": fm.trig, "sincos": fm.sincos}


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("is_query", [True, False])
def test_in_place_features_equal_the_differentiable_ones(name, is_query):
    """Outside autograd (sin and cos written into the halves of one tensor) the features and
    log-scales are those of the differentiable path, bit for bit, at awkward sizes (N = 63,
    D = 21, F = 19); the differentiable path is [sin(w x), cos(w x)] with its gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 63, 21, generator=g, dtype=torch.float64)
    w = torch.randn(19, 21, generator=g, dtype=torch.float64)
    with torch.no_grad():
        phi, log_scale = MAPS[name](x, w, is_query=is_query)
    leaf = x.clone().requires_grad_()
    phi_grad, log_scale_grad = MAPS[name](leaf, w, is_query=is_query)
    assert phi_grad.requires_grad and phi.shape == (2, 3, 63, 38)
    torch.testing.assert_close(phi, phi_grad.detach(), rtol=0, atol=0)
    if log_scale is not None:
        torch.testing.assert_close(log_scale, log_scale_grad.detach(), rtol=0, atol=0)
    u = x @ w.T
    torch.testing.assert_close(phi, torch.cat([u.sin(), u.cos()], -1), rtol=0, atol=0)
    weights = torch.randn(phi.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((phi_grad * weights).sum(), leaf)
    expected = (weights[..., :19] * u.cos() - weights[..., 19:] * u.sin()) @ w
    torch.testing.assert_close(grad, expected)


def test_in_place_features_hold_less():
    """Accounted (bytes, not time), N = 4096, F = 128: outside autograd a call holds the
    projection and the result (3F values a token), not also sin, cos and their concatenation;
    the differentiable path (x requiring grad) holds the latter."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 4096, 64, generator=g)
    w = torch.randn(128, 64, generator=g)
    per_token = 2 * 4096 * 128 * x.element_size()  # F values of every token of both heads

    def call():
        fm.sincos(x, w, is_query=False)

    with torch.no_grad():
        call()
        in_place = live_peak_bytes(call)
    x.requires_grad_()
    call()
    differentiable = live_peak_bytes(call)
    assert in_place <= 3 * per_token < 5 * per_token <= differentiable, (
        in_place, differentiable, per_token)
