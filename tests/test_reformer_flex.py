"""reformer's chunks by FlexAttention (effattn.sparse.lsh_flex), the banded ``flex`` strategy.

On the CPU the strategy is forced (inference only: FlexAttention's eager form has no backward
there) and must equal the CPU strategy to float64 rounding in every case of the pair rule:
shared QK or not, causal or not, padding, cross-attention, awkward lengths, one bucket. The
eager form evaluates the mask_mod densely and ignores the BlockMask's block lists, so the
lists are checked on their own: every tile holding an allowed pair is listed. On a GPU the
CUDA cases compare outputs and gradients with the CPU strategy's.
"""

import pytest
import torch

import effattn
from effattn import strategy
from effattn.sparse import flex, lsh_flex

CASES = [
    # (n, m, shared_qk, causal)
    (1, 1, False, True),
    (63, 63, False, False),
    (63, 63, False, True),
    (129, 129, False, True),
    (200, 200, False, False),
    (40, 70, False, False),
    (70, 40, False, False),
    (1, 1, True, True),
    (63, 63, True, False),
    (129, 129, True, True),
]


def _module(shared, n_hashes=3, bucket_size=8):
    return effattn.build("reformer", head_dim=8, heads=2, seed=1, n_hashes=n_hashes,
                         bucket_size=bucket_size, shared_qk=shared).eval()


def _inputs(n, m, shared, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, n, 8, generator=g, dtype=dtype)
    k = q if shared else torch.randn(2, 2, m, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 2, m, 5, generator=g, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def _padding(m, device="cpu"):
    mask = torch.zeros(2, m, dtype=torch.bool, device=device)
    mask[0, : min(3, m - 1)] = True
    mask[1, -min(7, m - 1):] = True
    return mask


@pytest.fixture
def launches(monkeypatch):
    """The dtype of q and the pattern named by every FlexAttention launch."""
    seen = []
    launch = flex.launch

    def spy(*args, **kwargs):
        seen.append((args[0].dtype, kwargs["what"].split()[0]))
        return launch(*args, **kwargs)

    monkeypatch.setattr(flex, "launch", spy)
    return seen


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("n", "m", "shared", "causal"), CASES)
def test_forced_flex_equals_the_cpu_strategy(n, m, shared, causal, padded, launches):
    module = _module(shared)
    q, k, v = _inputs(n, m, shared)
    mask = _padding(m) if padded and m > 1 else None
    with torch.no_grad():
        want = module(q, k, v, causal=causal, key_padding_mask=mask)
        assert launches == []
        with strategy.force(banded="flex"):
            got = module(q, k, v, causal=causal, key_padding_mask=mask)
    assert launches == [(torch.float64, "reformer")]  # one launch for every round
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("n_hashes", "bucket_size"), [(1, 8), (4, 16), (2, 64)])
def test_rounds_and_bucket_sizes(n_hashes, bucket_size, launches):
    """One round (nothing to deduplicate), four, and one bucket holding every key (exact
    softmax without shared QK)."""
    module = _module(False, n_hashes, bucket_size)
    q, k, v = _inputs(57, 57, False)
    with torch.no_grad():
        want = module(q, k, v, causal=True)
        with strategy.force(banded="flex"):
            got = module(q, k, v, causal=True)
    assert len(launches) == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if bucket_size >= 57:
        exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(got, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("slots", "chunk", "width", "chunks"), [
    (136, 8, 16, 17), (63, 21, 42, 3), (1, 1, 1, 1), (520, 40, 70, 13), (1024, 64, 128, 16)])
def test_block_lists_hold_every_allowed_pair(slots, chunk, width, chunks):
    padded_slots = -(-chunks * chunk // 128) * 128
    rows = -(-chunks * width // 128) * 128
    kv_num, kv_index = lsh_flex.block_tiles(padded_slots, rows, chunk, width, chunks,
                                            torch.device("cpu"))[:2]
    i = torch.arange(padded_slots)[:, None]
    j = torch.arange(rows)[None, :]
    allowed = (i // chunk == j // width) & (i < chunks * chunk) & (j < chunks * width)
    tiles = allowed.view(padded_slots // 128, 128, rows // 128, 128).any(3).any(1)
    listed = torch.zeros_like(tiles)
    for a in range(tiles.shape[0]):
        listed[a, kv_index[0, 0, a, : kv_num[0, 0, a]].long()] = True
    assert torch.equal(listed, tiles)


def test_half_precision_runs_in_its_dtype_and_hashes_in_fp32(launches):
    """bf16 inputs: the chunks in bf16 (FlexAttention keeps fp32 statistics), the buckets from
    fp32 copies, so that they are the CPU strategy's; the answers agree to bf16 rounding."""
    module = _module(False)
    q, k, v = _inputs(129, 129, False, dtype=torch.float32)
    half = tuple(t.bfloat16() for t in (q, k, v))
    with torch.no_grad():
        want = module(*(t.float() for t in half), causal=True)
        with strategy.force(banded="flex"):
            got = module(*half, causal=True)
    assert launches == [(torch.bfloat16, "reformer")] and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_forced_flex_on_the_cpu_refuses_gradients_clearly():
    module = _module(False)
    q, k, v = _inputs(63, 63, False)
    q.requires_grad_(True)
    with strategy.force(banded="flex"), pytest.raises(NotImplementedError, match="inference"):
        module(q, k, v, causal=True)


def test_inside_torch_compile_the_batched_path_runs(launches):
    """Traced, the call keeps the CPU strategy's batched chunks (no FlexAttention of its own);
    its answer is the eager flex strategy's."""
    module = _module(False)
    q, k, v = _inputs(63, 63, False)
    with torch.no_grad(), strategy.force(banded="flex"):
        want = module(q, k, v, causal=True)
        got = torch.compile(module, backend="eager", fullgraph=True)(q, k, v, causal=True)
    assert len(launches) == 1  # the eager call's
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "m", "shared", "causal"), [c for c in CASES if c[0] > 1])
def test_on_cuda_outputs_and_gradients_equal_the_cpu_strategy(n, m, shared, causal):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    module = _module(shared).cuda()
    q, k, v = _inputs(n, m, shared, dtype=torch.float32, device="cuda")
    mask = _padding(m, "cuda")
    results = []
    for banded in ("cpu", "flex"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, v)]
        qq = leaves[0]
        kk = qq if shared else k.detach().clone().requires_grad_(True)
        if not shared:
            leaves.insert(1, kk)
        with strategy.force(banded=banded):
            out = module(qq, kk, leaves[-1], causal=causal, key_padding_mask=mask)
        weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
        results.append([out, *torch.autograd.grad((out * weights).sum(), leaves)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
