"""Every registered method equals the dense reference its spec declares.

``spec.reference(module, q, k, v, ...)`` binds the module's parameters, buffers and eval-mode
random draws to the naive formulas of ``effattn.naive``. Here, for every method and every
variant its spec lists, the module's output and its gradients (q, k, v, the call inputs it
takes, the module's parameters) must match it in float64 on awkward shapes: N = 63, D = 21,
Dv = 10, cross-attention with M = 50, left and right padding, and options small enough that
chunks, windows, buckets, blocks, segments and strides all end in a partial one. The optional
call inputs a spec declares (softmax's causal ``sliding_window`` and per-head ``sinks``) run
alone and together, and their gradients (the tensors') are compared too.
"""

import pytest
import torch
from conftest import padding, qkv, small_options

import effattn

B, H, N, M_CROSS, D, DV = 2, 3, 63, 50, 21, 10
MAX_LEN = 80  # > N: length-dependent parameters are sliced

# Small settings, by option name, for whichever methods take that option: 63 positions are
# 6 chunks of 10 and a tail of 3, 7 blocks with a last one of 3, 10 uneven segments, and so on.
SMALL = {
    "chunk_size": 10,
    "num_features": 24,
    "window": 9,
    "global_tokens": (0, 31, 62),
    "block_size": 10,
    "num_random_blocks": 2,
    "num_landmarks": 10,
    "proj_len": 17,
    "stride": 8,
    "c": 3,
    "ratio": 0.3,
    "bucket_size": 8,
    "n_hashes": 3,
    "proj_dim": 5,
}
# Settings no variant lists, by option name, run as well: (value, whether cross-attention runs;
# a convolution of V and a dilated window need N == M).
EXTRA = {"conv_kernel": (5, False), "dilation": (2, False), "softcap": (2.0, True)}
# Values of the int call inputs, by name: a sliding window shorter than N, local's own (SMALL).
INT_INPUTS = {"sliding_window": 9}
# Tighter than this only where a method's own tests say so: FAVOR's cosine features can be
# negative, so its normaliser cancels and rounding is amplified (tests/test_kernelized_methods.py).
TOLERANCE = {"favor": 1e-7}
MODES = {  # name: (causal, padded, cross)
    "full": (False, False, False),
    "padded": (False, True, False),
    "causal": (True, False, False),
    "causal-padded": (True, True, False),
    "cross": (False, False, True),
    "cross-padded": (False, True, True),
}


def _label(options):
    return "-".join(f"{key}={value}" for key, value in options.items())


def _cases():
    for name in effattn.methods():
        spec = effattn.spec(name)
        small = small_options(name, SMALL)
        settings = [("small", small, spec.cross, ())] + [
            (_label(variant.options), {**small, **variant.options}, spec.cross, ())
            for variant in spec.variants
        ] + [(_label({key: value}), {**small, key: value}, cross and spec.cross, ())
             for key, (value, cross) in EXTRA.items() if key in spec.options]
        # Each optional call input alone, then all of them on top of the extra settings that
        # combine with any mode (softmax: soft cap, sliding window and sinks at once).
        optional = tuple(c.name for c in spec.call_inputs if not c.required)
        settings += [(key, small, spec.cross, (key,)) for key in optional]
        extra = {key: value for key, (value, cross) in EXTRA.items()
                 if cross and key in spec.options}
        if len(optional) > 1 or (optional and extra):
            label = "+".join([_label(extra)] * bool(extra) + list(optional))
            settings.append((label, {**small, **extra}, spec.cross, optional))
        if spec.options.get("window", "") is None:
            # A kernelized method: its window hybrid too, on each setting (no cross-attention:
            # the window needs aligned positions).
            settings += [(f"{label}-window=9", {**options, "window": 9}, False, ())
                         for label, options, _, chosen in list(settings) if not chosen]
        for label, options, cross_ok, chosen in settings:
            given = [*spec.required_inputs(options),
                     *(c for c in spec.call_inputs if c.name in chosen)]
            causal_only = any(c.causal_only for c in given)
            for mode, (causal, padded, cross) in MODES.items():
                if ((causal and not spec.causal) or (padded and not spec.padding_mask)
                        or (cross and not cross_ok) or (causal_only and not causal)):
                    continue
                yield pytest.param(name, options, mode, chosen, id=f"{name}-{label}-{mode}")


def call_input(c, dims, seed=1):
    """Values for the call input ``c``: an int from INT_INPUTS; a tensor inside the middle 60%
    of its bounds, else N(0, 1)."""
    if c.kind == "int":
        return INT_INPUTS[c.name]
    shape = c.expected_shape(dims)
    g = torch.Generator().manual_seed(seed)
    if c.bounds is None:
        return torch.randn(shape, dtype=torch.float64, generator=g)
    low, high = c.bounds
    return low + (high - low) * (0.2 + 0.6 * torch.rand(shape, dtype=torch.float64, generator=g))


def _build(name, options):
    module = effattn.build(name, head_dim=D, heads=H, max_len=MAX_LEN, seed=0, **options)
    if hasattr(module, "slice_elements"):
        module.slice_elements = 500  # kernelized core: a few chunks per slice of the sequence
    return module.double().eval()


def test_every_method_declares_a_reference():
    missing = [name for name in effattn.methods() if not callable(effattn.spec(name).reference)]
    assert not missing, f"no dense reference in the spec of {missing}"


@pytest.mark.parametrize("name, options, mode, chosen", list(_cases()))
def test_module_equals_its_reference(name, options, mode, chosen, device):
    causal, padded, cross = MODES[mode]
    spec = effattn.spec(name)
    module = _build(name, options).to(device)
    q, k, v = (t.to(device) for t in qkv(b=B, h=H, n=N, m=M_CROSS if cross else N, d=D, dv=DV))
    mask = padding(B, k.shape[2]).to(device) if padded else None
    dims = {"B": B, "H": H, "N": N, "M": k.shape[2], "D": D, "Dv": DV}
    given = [*spec.required_inputs(options), *(c for c in spec.call_inputs if c.name in chosen)]
    call = {c.name: call_input(c, dims) for c in given}
    tensors = {key: value.to(device) for key, value in call.items()
               if isinstance(value, torch.Tensor)}
    call.update(tensors)
    inputs = [t.requires_grad_() for t in (q, k, v, *tensors.values())]
    params = [p for p in module.parameters() if p.requires_grad]

    out = module(q, k, v, causal=causal, key_padding_mask=mask, **call)
    ref = spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask, **call)
    tol = TOLERANCE.get(name, 1e-10)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)

    probe = torch.randn(out.shape, dtype=out.dtype,
                        generator=torch.Generator().manual_seed(2)).to(device)
    wrt = inputs + params
    got = torch.autograd.grad((out * probe).sum(), wrt, allow_unused=True)
    want = torch.autograd.grad((ref * probe).sum(), wrt, allow_unused=True)
    names = ["q", "k", "v", *tensors] + [n for n, p in module.named_parameters() if p.requires_grad]
    for arg, a, b in zip(names, got, want, strict=True):
        if a is None or b is None:  # an input neither path reads (fnet's q and k)
            assert a is None and b is None, f"grad {arg}: only one of the two paths uses it"
            continue
        torch.testing.assert_close(a, b, rtol=tol, atol=tol,
                                   msg=lambda text, arg=arg: f"grad {arg}: {text}")
