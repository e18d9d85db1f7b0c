"""Large logits: every method either answers with the right values, or refuses with its documented
message; it never outputs a silent zero row, NaN or inf.

q and k entries ~ N(0, 50²) and N(0, 100²) at D = 16 give logits of 1e4 and more. There a
finite constant standing in for minus infinity (a mask value, the max of an empty row) competes
with the real scores, and a masked max or an underflowing exp turns a query that sees keys into
an exact zero row. A method may refuse such inputs loudly, with the ValueError its docs name:
the kernelized methods when the product of their stabilised features underflows (kernelized.core,
"the attention denominator ... is 0"), Nyström when its landmark kernel is numerically singular
(mechanisms/nystrom.py). Any other error fails. If it answers, its rows equal the float64 dense
reference on the same large inputs, a query that sees no key outputs exactly 0 (the contract for
fully padded rows), and nothing is NaN or inf, gradients included. Every method answers at least
one case at entries ~50, except Nyström, which refuses all of them (its docstring says why).

Which queries see a key is read from the method's dense reference in float64 on the same
directions at unit scale (ordinary logits): its rows are 0 exactly where a query sees nothing.
Where the float64 reference itself overflows (random features written out without their
stabilising log-scale), a kernelized method's rows are compared with the same explicit kernel
sum, each key's feature scale taken relative to the largest (the query's cancels).
"""

import re

import pytest
import torch
from conftest import padding, small_options

import effattn
from effattn import naive
from effattn.kernelized.base import KernelizedAttention

B, H, D, DV = 2, 2, 16, 5
LENGTHS = (63, 143)
MAGNITUDES = (50.0, 100.0)
# Options small enough that windows, blocks, buckets and strides end in a partial one; reformer
# with bucket_size 16 and two rounds.
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
# The documented refusals, by the start of their message.
UNDERFLOW = (r"{name}: the attention denominator Σ_j φ\(q_i\)·φ\(k_j\) is 0 in "
             r"torch\.float(32|64) \(or subnormal")
NYSTROM = (r"nystrom cannot approximate these q, k: the Nyström weights of query \d+ \(batch "
           r"\d+, head \d+\) sum to .*numerically singular")
# Methods that refuse every case (Nystromformer's docstring: peaked logits make its landmark
# kernel singular).
REFUSES_EVERY_CASE = {"nystrom"}
# Tolerance of an answer against the float64 reference, by the answer's dtype: float32 rounds
# logits of 1e4 by about 1e-3.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 5e-3}


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


def _refusal(module):
    """The pattern a refusal of ``module`` must match, None if it documents none."""
    name = module.spec.name
    if name == "nystrom":
        return NYSTROM
    if isinstance(module, KernelizedAttention):
        return UNDERFLOW.format(name=name)
    return None


def _kernel_reference(module, q, k, v, causal, mask, call):
    """A window-less kernelized module's explicit kernel sum in float64, each key's feature scale
    taken relative to the largest among the keys its query sees (the query's own cancels); None
    for a window hybrid. Rows whose sum underflows even so are NaN."""
    if not isinstance(module, KernelizedAttention) or module.window is not None:
        return None
    with torch.no_grad():
        phi_q, _ = module.features(q, is_query=True)
        phi_k, log_k = module.features(k, is_query=False)
        w = naive.kernel_weights(q.shape[2], k.shape[2], causal=causal, key_padding_mask=mask,
                                 gate=call.get("gate"))
        a = phi_q @ phi_k.transpose(-2, -1)
        if log_k is not None:
            log_w = log_k.transpose(-2, -1).expand_as(a).masked_fill(w == 0, -torch.inf)
            top = log_w.amax(-1, keepdim=True)
            a = a * torch.exp(log_w - torch.where(torch.isfinite(top), top, 0.0))
        a = a * w
        sees = w.sum(-1, keepdim=True) > 0
        return torch.where(sees, (a @ v) / a.sum(-1, keepdim=True), 0.0)


def _reference(module, q, k, v, causal, mask, call):
    """The float64 dense reference on the large inputs, rows that overflow there replaced by
    :func:`_kernel_reference`'s; rows still not finite are NaN (not compared)."""
    with torch.no_grad():
        ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask,
                                    **call)
    finite = torch.isfinite(ref).all(-1, keepdim=True)
    if not finite.all():
        other = _kernel_reference(module, q, k, v, causal, mask, call)
        if other is not None:
            ref = torch.where(finite, ref, other)
    return ref.masked_fill(~torch.isfinite(ref).all(-1, keepdim=True), torch.nan)


@pytest.mark.parametrize("name, options", list(_cases()))
def test_large_logits_are_answered_right_or_refused_as_documented(name, options, one_thread):
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
    refusal = _refusal(modules[torch.float64])
    answered = {magnitude: 0 for magnitude in MAGNITUDES}
    checked_rows = {magnitude: 0 for magnitude in MAGNITUDES}
    refused = []
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
                sees = spec.reference(modules[torch.float64], q, k, v, causal=causal,
                                      key_padding_mask=mask, **call).ne(0).any(-1)
                for magnitude in MAGNITUDES:
                    ref = _reference(modules[torch.float64], q * magnitude, k * magnitude, v,
                                     causal, mask, call)
                    for dtype, module in modules.items():
                        where = f"{name} N={n} causal={causal} {pad_name} {dtype} x{magnitude:g}"
                        big_q = (q * magnitude).to(dtype).requires_grad_()
                        big_k = big_q if shared else (k * magnitude).to(dtype).requires_grad_()
                        small_v = v.to(dtype).requires_grad_()
                        given = {key: t.to(dtype) for key, t in call.items()}
                        try:
                            out = module(big_q, big_k, small_v, causal=causal,
                                         key_padding_mask=mask, **given)
                        except ValueError as err:
                            # Only the documented refusal counts; anything else fails here.
                            assert refusal is not None and re.match(refusal, str(err)), (
                                f"{where}: not the documented refusal: {err}")
                            refused.append(where)
                            continue
                        answered[magnitude] += 1
                        zero = (out == 0).all(-1)
                        assert not zero[sees].any(), (
                            f"{where}: {int(zero[sees].sum())} zero rows of queries that see a key"
                        )
                        assert not out[~sees].any(), f"{where}: a query that sees no key is not 0"
                        assert torch.isfinite(out).all(), f"{where}: NaN or inf"
                        rows = torch.isfinite(ref).all(-1)
                        tol = TOLERANCE[dtype]
                        torch.testing.assert_close(out.detach().double()[rows], ref[rows],
                                                   rtol=tol, atol=tol, msg=where)
                        checked_rows[magnitude] += int(rows.sum())
                        leaves = [big_q, small_v] if shared else [big_q, big_k, small_v]
                        # allow_unused: fnet reads neither q nor k.
                        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
                        assert all(g is None or torch.isfinite(g).all() for g in grads), (
                            f"{where}: NaN or inf in the gradients"
                        )
    if name in REFUSES_EVERY_CASE:
        assert sum(answered.values()) == 0 and refused, (name, answered)
    else:
        assert answered[50.0] > 0, f"{name} {options}: answered no case at entries ~50"
        assert checked_rows[50.0] > 0, f"{name} {options}: no answer at ~50 had its values checked"


def test_nystrom_answers_large_logits_in_its_exact_limit(one_thread):
    """With at least as many landmarks as tokens every landmark is one token, and Nyström is
    exact softmax attention: it answers logits of 1e4, equal to softmax's in float64."""
    q, k, v = _inputs(30, seed=3)
    module = effattn.build("nystrom", head_dim=D, heads=H, num_landmarks=32).double().eval()
    mask = padding(B, 30)
    out = module(50 * q, 50 * k, v, key_padding_mask=mask)
    want = naive.softmax_attention(50 * q, 50 * k, v, key_padding_mask=mask, scale=module.scale)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
