"""Kernelized methods stay trustworthy at extreme inputs: no future leakage through the
stabiliser in fp32, no silent all-zero rows."""

import pytest
import torch
import torch.nn.functional as F
from conftest import qkv

import effattn

KERNELIZED = [
    ("performer", {"feature_map": "positive"}),
    ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "trig"}),
    ("performer", {"feature_map": "relu"}),
    ("favor", {}),
    ("rfa", {}),
    ("rfa", {"gated": True}),
    ("linear", {}),
]


def _id(variant):
    name, opts = variant
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def _build(name, opts, d, dtype, chunk=16):
    if name != "linear":
        opts = {"num_features": 24, **opts}
    module = effattn.build(name, head_dim=d, heads=3, seed=0, chunk_size=chunk, **opts)
    module = module.to(dtype).eval()
    module.slice_elements = 3000  # slices of a few chunks: the leak test crosses slice borders
    return module


def _assert_rel_close(out, ref, rtol):
    err = ((out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < rtol, f"relative error {err:.2e}"


@pytest.mark.parametrize("variant", KERNELIZED, ids=_id)
@pytest.mark.parametrize("t", [37, 47], ids=["mid-chunk", "chunk-end"])
def test_large_future_keys_leave_earlier_fp32_outputs_alone(variant, t):
    """Keys after t scaled to norm 30 (log-scales ~100 for trigonometric maps): fp32 outputs at
    positions <= t still equal the float64 ones computed without those keys, in the forward and
    through prefill (a split at 23, mid-chunk, carries a state)."""
    name, opts = variant
    n, d = 100, 21
    q, k, v = qkv(b=2, h=3, n=n, d=d, dv=5, scale=0.7)
    gate = torch.sigmoid(torch.randn(2, 3, n, dtype=torch.float64))
    kw = (lambda a, b: {"gate": gate[:, :, a:b]}) if opts.get("gated") else (lambda a, b: {})
    ref = _build(name, opts, d, torch.float64)(q, k, v, causal=True, **kw(0, n))[:, :, : t + 1]
    k_big = k.clone()
    k_big[:, :, t + 1 :] = 30 * F.normalize(k[:, :, t + 1 :], dim=-1)
    q, k_big, v, gate = q.float(), k_big.float(), v.float(), gate.float()
    module = _build(name, opts, d, torch.float32)
    out = module(q, k_big, v, causal=True, **kw(0, n))
    _assert_rel_close(out[:, :, : t + 1], ref, 1e-4)
    first, state = module.prefill(q[:, :, :23], k_big[:, :, :23], v[:, :, :23], **kw(0, 23))
    rest, _ = module.prefill(q[:, :, 23:], k_big[:, :, 23:], v[:, :, 23:], state, **kw(23, n))
    _assert_rel_close(torch.cat([first, rest], 2)[:, :, : t + 1], ref, 1e-4)
