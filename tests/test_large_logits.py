"""Large logits (issue 19): no method that answers outputs a silent zero row, NaN or inf.

q and k entries ~ N(0, 50²) and N(0, 100²) at D = 16 give logits of 1e4 and more. There a
finite constant standing in for minus infinity (a mask value, the max of an empty row) competes
with the real scores, and a masked max or an underflowing exp turns a query that sees keys into
an exact zero row. A method may refuse such inputs loudly (a ValueError, as the kernelized and
Nyström paths do when their weights underflow); if it answers, a query that sees a key never
outputs an exact zero row, one that sees none outputs exactly 0 (the contract for fully
padded rows), and nothing is NaN or inf, gradients included.

Which queries see a key is read from the method's dense reference in float64 on the same
directions at unit scale (ordinary logits): its rows are 0 exactly where a query sees nothing.
"""

import itertools

import pytest
import torch
from conftest import padding, small_options

import effattn

B, H, D, DV = 2, 2, 16, 5
LENGTHS = (63, 143)
MAGNITUDES = (50.0, 100.0)
# Options small enough that windows, blocks, buckets and strides end in a partial one; reformer
# as in the issue (bucket_size 16, two rounds).
SMALL = {
    "bucket_size": 16,
    "n_hashes": 2,
    "window": 9,
    "block_size": 10,
    "num_landmarks": 10,
    "proj_len": 17,
    "stride": 8,
    "c": 3,
    "ratio": 0.3,
    "num_features": 24,
    "global_tokens": (0, 31),
}
PADDING = {  # name: mask of (B, N), None for no padding
    "none": lambda n: None,
    "padded": lambda n: padding(B, n),
    "one-fully-padded": lambda n: padding(B, n).index_fill_(0, torch.tensor([0]), True),
}


def _cases():
    for name in effattn.methods():
        spec = effattn.spec(name)
        small = small_options(name, SMALL)
        settings = [("small", small)] + [
            ("-".join(f"{k}={v}" for k, v in variant.options.items()),
             {**small, **variant.options})
            for variant in spec.variants
        ]
        if spec.options.get("window", "") is None:  # a kernelized method's window hybrid
            settings.append(("window=9", {**small, "window": 9}))
        if "shared_qk" in spec.options:
            settings.append(("shared_qk", {**small, "shared_qk": True}))
        for label, options in settings:
            yield pytest.param(name, options, id=f"{name}-{label}")


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, torch.randn(B, H, n, DV, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name, options", list(_cases()))
def test_large_logits_give_no_zero_row_and_no_nan(name, options, one_thread):
    spec = effattn.spec(name)
    inputs = spec.required_inputs(options)
    causal_only = any(c.causal_only for c in inputs)
    shared = options.get("shared_qk", False)
    # One seed: the same random draws in both precisions.
    modules = {
        dtype: effattn.build(name, head_dim=D, heads=H, max_len=160, seed=0, **options)
        .to(dtype).eval()
        for dtype in (torch.float32, torch.float64)
    }
    for n in LENGTHS:
        q, k, v = _inputs(n, seed=n)
        k = q if shared else k
        dims = {"B": B, "H": H, "N": n, "M": n, "D": D, "Dv": DV}
        # 70% of the way through its bounds (a gate of 0.7), or 0.7 when it has none.
        call = {c.name: torch.full(c.expected_shape(dims), 0.7 if c.bounds is None
                                   else c.bounds[0] + 0.7 * (c.bounds[1] - c.bounds[0]),
                                   dtype=torch.float64) for c in inputs}
        for causal in (False, True):
            if (causal and not spec.causal) or (causal_only and not causal):
                continue
            for pad_name, make_mask in PADDING.items():
                mask = make_mask(n)
                if mask is not None and not spec.padding_mask:
                    continue
                ref = spec.reference(modules[torch.float64], q, k, v, causal=causal,
                                     key_padding_mask=mask, **call)
                sees = ref.ne(0).any(-1)
                for (dtype, module), magnitude in itertools.product(modules.items(), MAGNITUDES):
                    where = f"{name} N={n} causal={causal} {pad_name} {dtype} x{magnitude:g}"
                    big_q = (q * magnitude).to(dtype).requires_grad_()
                    big_k = big_q if shared else (k * magnitude).to(dtype).requires_grad_()
                    small_v = v.to(dtype).requires_grad_()
                    given = {key: t.to(dtype) for key, t in call.items()}
                    try:
                        out = module(big_q, big_k, small_v, causal=causal, key_padding_mask=mask,
                                     **given)
                    except ValueError:
                        continue  # a loud refusal, which the contract allows
                    zero = (out == 0).all(-1)
                    assert not zero[sees].any(), (
                        f"{where}: {int(zero[sees].sum())} zero rows of queries that see a key"
                    )
                    assert not out[~sees].any(), f"{where}: a query that sees no key is not 0"
                    assert torch.isfinite(out).all(), f"{where}: NaN or inf"
                    leaves = [big_q, small_v] if shared else [big_q, big_k, small_v]
                    # allow_unused: fnet reads neither q nor k.
                    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
                    assert all(g is None or torch.isfinite(g).all() for g in grads), (
                        f"{where}: NaN or inf in the gradients"
                    )
