import importlib.util
import json
import os
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

import effattn

# Without a GPU, Triton kernels (the kernelized engine's triton strategy) run on CPU tensors
# under Triton's interpreter, which is chosen when a kernel is defined: before any test imports
# effattn's kernels. With one, they compile for it and its CUDA cases run them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# For a test that runs Triton kernels on CPU tensors, through a script that is not given a
# device: on a machine with a GPU the kernels compile for it, and such a test is skipped.
interpreted = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CPU case: Triton's interpreter is off on a machine with "
                                        "a GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """The device a reference comparison runs on: the CPU, and CUDA when one is present.

    Without a GPU the CUDA case is skipped and says so; ``pytest -m cuda`` (benchmarks/gpu.sh)
    runs only the CUDA cases.
    """
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA case: no CUDA device on this machine")
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def qkv(b=2, h=3, n=63, m=None, d=21, dv=None, dtype=torch.float64, scale=1.0, seed=0):
    """Random q, k, v with the awkward default shapes the contract tests use."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    dv = d if dv is None else dv
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, h, m, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, h, m, dv, generator=g, dtype=dtype)
    return q, k, v


def load_script(path: Path, name: str):
    """A script that is not part of the package (benchmarks/*.py) imported as module ``name``,
    registered in sys.modules first: its dataclasses look their module up while made."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def assert_prefill_continues(module, n, cut):
    """Two prefills, the second from the first's state, equal the float64 causal reference in
    outputs and in q, k, v's gradients: the gradient reaches the first through the second."""
    q, k, v = (t.requires_grad_(True) for t in qkv(n=n, d=21, dv=5, scale=0.5))
    first, state = module.prefill(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut])
    second, _ = module.prefill(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], state)
    out = torch.cat([first, second], 2)
    ref = module.spec.reference(module, q, k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


# Every kernelized map a causal strategy runs through its row core, small (F = 24 projections),
# for the strategies' tests (gpu, triton). hedgehog's exp form runs the per-feature core: tests of
# its own (tests/test_exponents_gpu.py).
STRATEGY_VARIANTS = [
    ("performer", {"feature_map": "positive"}),
    ("performer", {"feature_map": "hyperbolic"}),
    ("performer", {"feature_map": "trig"}),
    ("performer", {"feature_map": "relu"}),
    ("favor", {}),
    ("rfa", {"feature_map": "sincos"}),
    ("rfa", {"feature_map": "arccos", "sigma": 0.7}),
    ("rfa", {"learn_sigma": True}),
    ("linear", {}),
    ("hedgehog", {"feature_map": "softmax_dim"}),
    ("taylor", {}),
]
# Maps whose features can be negative: their normaliser's rounding is amplified.
SIGNED_MAPS = {("performer", "trig"), ("favor", None)}


def variant_id(variant):
    name, opts = variant
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def make_kernelized(name, opts, d=21, h=3, chunk=16):
    """A small float64 kernelized module in eval mode (no redraw between calls)."""
    options = {"chunk_size": chunk, **opts}
    if name in ("performer", "favor", "rfa"):
        options.setdefault("num_features", 24)
    return effattn.build(name, head_dim=d, heads=h, seed=0, **options).double().eval()


def count_calls(monkeypatch, targets):
    """Counts of the calls to functions during a test: ``targets`` maps a key to (module,
    function name); each function is wrapped (monkeypatched back after the test). Returns the
    counts, key -> calls so far."""
    counts = dict.fromkeys(targets, 0)
    for key, (owner, name) in targets.items():
        original = getattr(owner, name)

        def spy(*args, _key=key, _original=original, **kwargs):
            counts[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return counts


def padding(b, m, seed=0):
    """A (B, M) padding mask: left padding on batch 0, right padding elsewhere, never all padded."""
    mask = torch.zeros(b, m, dtype=torch.bool)
    if m > 1:
        mask[0, : max(1, m // 5)] = True
        for i in range(1, b):
            mask[i, m - max(1, m // (3 + i)) :] = True
    return mask


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads; one keeps the suite cheap on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_results(out: Path) -> dict:
    """The results.json a CLI wrote into ``out``."""
    return json.loads((out / "results.json").read_text())


def assert_png(path: Path) -> None:
    """``path`` is a real PNG image of a plausible plot size."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def small_options(name: str, table: dict) -> dict:
    """The entries of ``table`` (small settings by option name) that method ``name`` takes, less
    the window hybrid's options of the kernelized methods (None by default: setting ``window``
    switches the method to its hybrid, which tests/test_window_hybrid.py and the hybrid cases
    of the all-methods tests cover on their own)."""
    import effattn
    from effattn.kernelized.base import WINDOW_OPTIONS

    options = effattn.spec(name).options
    return {key: value for key, value in table.items() if key in options
            and not (key in WINDOW_OPTIONS and options[key] == WINDOW_OPTIONS[key])}

