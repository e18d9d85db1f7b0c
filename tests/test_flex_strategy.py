"""The FlexAttention strategy of the banded engine (effattn.sparse.flex) computes the CPU engine's
patterns.

On the CPU (CI), without a kernel: every pattern's rule (the one definition in
effattn.sparse.pieces, FlexAttention's mask_mod), evaluated densely by broadcasting and by
FlexAttention's own vmap (``create_mask``), equals the mask the CPU engine computes and the mask
of the naive reference, for awkward N and every option; its cached BlockMask lists every allowed
pair. Then the forced strategy end to end on the CPU, FlexAttention's eager form, forward only
(torch has no FlexAttention backward on the CPU), against the float64 references. The CUDA
cases of the ``device`` fixture run the compiled kernel, outputs and gradients.

A pattern's mask is read off an engine by attending with q = k = 0 (equal scores) over
v = identity: out[i, j] = 1 / |allowed(i)| where j is allowed, 0 elsewhere.
"""

import math

import pytest
import torch
from conftest import padding, qkv
from torch._dynamo.testing import CompileCounterWithBackend

import effattn
import effattn.sparse
from effattn import strategy
from effattn.sparse import Band, Blocks, Globals, sparse_attention
from effattn.sparse import flex as flex_strategy
from effattn.sparse.pieces import Columns, Summary, dense_mask, union

flex_api = pytest.importorskip("torch.nn.attention.flex_attention")

HEADS, HEAD_DIM = 3, 16

# (method, options, causal): every option of every banded method.
CASES = [
    ("local", {"window": 16}, False),
    ("local", {"window": 16}, True),
    ("local", {"window": 15, "dilation": 3}, False),
    ("local", {"window": 16, "dilation": 2}, True),
    ("local", {"window": 1}, True),
    ("longformer", {"window": 16}, False),
    ("longformer", {"window": 10, "global_tokens": (3, 40, 62)}, False),
    ("longformer", {"window": 10, "global_tokens": ()}, False),
    ("bigbird", {"block_size": 16}, False),
    ("bigbird", {"block_size": 8, "num_global_blocks": 2, "num_random_blocks": 2}, False),
    ("bigbird", {"block_size": 8, "num_global_blocks": 0, "num_random_blocks": 5}, False),
    ("sparse-strided", {"stride": None}, False),
    ("sparse-strided", {"stride": 7}, True),
    ("sparse-strided", {"stride": 200}, True),
    ("sparse-fixed", {"stride": None, "c": 3}, False),
    ("sparse-fixed", {"stride": 9, "c": 4}, True),
    ("sparse-fixed", {"stride": 9, "c": 20}, False),
]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in o.items())}-{'causal' if c else 'full'}"
       for m, o, c in CASES]


def _module(method, options, seed=3):
    return effattn.build(method, head_dim=HEAD_DIM, heads=HEADS, seed=seed, **options).eval()


def _read_mask(attend, n, heads=HEADS):
    """The (H, N, N) pattern an engine computes (see the module docstring)."""
    q = torch.zeros(1, heads, n, HEAD_DIM, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64).expand(1, heads, n, n)
    with torch.no_grad():
        return attend(q, q.clone(), v)[0] > 0


def _pieces_of(module, n, causal, **call):
    """The pieces the module hands to the banded engine for N = n."""
    seen = []
    real = flex_strategy.sparse_attention

    def record(q, k, v, pieces, **kwargs):
        seen.append(list(pieces))
        return real(q, k, v, pieces, **kwargs)

    q = torch.zeros(1, HEADS, n, HEAD_DIM)
    with strategy.force(banded="flex"), torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(flex_strategy, "sparse_attention", record)
        module(q, q, q, causal=causal, **call)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("n", [63, 129])
@pytest.mark.parametrize(("method", "options", "causal"), CASES, ids=IDS)
def test_rule_is_the_cpu_engines_and_the_references_pattern(method, options, causal, n):
    module = _module(method, options)
    pieces = _pieces_of(module, n, causal)
    rule = dense_mask(pieces, HEADS, n)
    with strategy.force(banded="cpu"):
        engine = _read_mask(lambda q, k, v: module(q, k, v, causal=causal), n)
    reference = _read_mask(
        lambda q, k, v: module.spec.reference(module, q, k, v, causal=causal), n)
    assert torch.equal(rule, engine)
    assert torch.equal(rule, reference)
    # FlexAttention's own evaluation of the mask_mod (vmap over scalar indices) agrees.
    mask_mod = flex_strategy.block_mask(pieces, HEADS, n, torch.device("cpu")).mask_mod
    by_vmap = flex_api.create_mask(mask_mod, 1, HEADS, n, n, device="cpu")[0]
    assert torch.equal(by_vmap, rule)


@pytest.mark.parametrize("n", [63, 129])
@pytest.mark.parametrize(("call", "build"), [
    ({"causal": True, "sliding_window": 9}, {}),
    ({"causal": True, "sliding_window": 1}, {}),
    ({"causal": True}, {"softcap": 2.0}),
    ({"causal": False}, {"softcap": 2.0}),
])
def test_softmax_patterns_are_the_cpu_engines_and_the_references(call, build, n):
    """softmax's sliding window (Mistral's), and the causal or full band a soft cap needs."""
    module = effattn.build("softmax", head_dim=HEAD_DIM, heads=HEADS, **build)
    call = dict(call)
    causal = call.pop("causal")
    rule = dense_mask(_pieces_of(module, n, causal, **call), HEADS, n)
    with strategy.force(banded="cpu"):
        engine = _read_mask(lambda q, k, v: module(q, k, v, causal=causal, **call), n)
    reference = _read_mask(
        lambda q, k, v: module.spec.reference(module, q, k, v, causal=causal, **call), n)
    assert torch.equal(rule, engine)
    assert torch.equal(rule, reference)


@pytest.mark.parametrize("n", [63, 129, 256])
@pytest.mark.parametrize(("method", "options", "causal"), CASES, ids=IDS)
def test_block_mask_lists_every_allowed_pair_and_full_blocks_are_full(method, options, causal,
                                                                       n):
    pieces = _pieces_of(_module(method, options), n, causal)
    size = 32
    heads = flex_strategy.mask_heads(pieces, HEADS)
    blocks = flex_strategy.build_block_mask(union(pieces, n, torch.device("cpu")), heads, n,
                                            torch.device("cpu"), block_size=size)
    rule = dense_mask(pieces, heads, n)
    nb = -(-n // size)
    tiles = torch.zeros(heads, nb * size, nb * size, dtype=torch.bool)
    tiles[:, :n, :n] = rule
    touched = tiles.view(heads, nb, size, nb, size).any(4).any(2)
    listed = blocks.to_dense()[0].bool()
    assert torch.equal(listed, touched)
    full = torch.zeros_like(listed)
    for h in range(heads):
        for a in range(nb):
            count = int(blocks.full_kv_num_blocks[0, h, a])
            full[h, a, blocks.full_kv_indices[0, h, a, :count].long()] = True
    inside = tiles[:, :n, :n].view(heads, nb, size, nb, size) if n % size == 0 else None
    if inside is not None:
        assert torch.equal(full, inside.all(4).all(2))
    assert not (full & ~touched).any()


def test_block_masks_are_cached_per_pattern_n_and_device():
    pieces = [Band(5, 5, 2)]
    cpu = torch.device("cpu")
    first = flex_strategy.block_mask(pieces, HEADS, 100, cpu)
    assert flex_strategy.block_mask([Band(5, 5, 2)], HEADS, 100, cpu) is first
    assert flex_strategy.block_mask(pieces, HEADS, 101, cpu) is not first
    assert flex_strategy.block_mask([Band(5, 4, 2)], HEADS, 100, cpu) is not first
    tokens = [Band(3, 3), Globals(torch.tensor([0, 7]))]
    same = flex_strategy.block_mask(tokens, HEADS, 100, cpu)
    assert flex_strategy.block_mask([Band(3, 3), Globals(torch.tensor([0, 7]))], HEADS, 100,
                                    cpu) is same
    assert flex_strategy.block_mask([Band(3, 3), Globals(torch.tensor([0, 8]))], HEADS, 100,
                                    cpu) is not same


def test_bigbird_blocks_follow_the_seed_and_the_state_dict():
    n = 129
    a = _pieces_of(_module("bigbird", {"block_size": 8}, seed=1), n, False)
    b = _pieces_of(_module("bigbird", {"block_size": 8}, seed=2), n, False)
    assert not torch.equal(dense_mask(a, HEADS, n), dense_mask(b, HEADS, n))
    loaded = _module("bigbird", {"block_size": 8}, seed=2)
    loaded.load_state_dict(_module("bigbird", {"block_size": 8}, seed=1).state_dict())
    assert torch.equal(dense_mask(_pieces_of(loaded, n, False), HEADS, n), dense_mask(a, HEADS, n))


@pytest.mark.parametrize("n", [63, 129])
@pytest.mark.parametrize("chunk", [8, 32])
def test_llama4_chunks_are_the_blocks_piece(n, chunk):
    """Llama 4's chunked attention (``attention_chunk_size``): causal within chunks of C."""
    pieces = [Blocks(None, chunk, torch.ones(chunk, chunk, dtype=torch.bool).tril())]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(dense_mask(pieces, 1, n)[0], (i // chunk == j // chunk) & (j <= i))
    q, k, v = qkv(n=n)
    mask = padding(q.shape[0], n)
    with strategy.force(banded="flex"):
        out, lse = sparse_attention(q, k, v, pieces, scale=0.3, key_mask=mask)
    ref, ref_lse = sparse_attention(q, k, v, pieces, scale=0.3, key_mask=mask)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("n", [63, 129])
@pytest.mark.parametrize(("method", "options", "causal"), CASES, ids=IDS)
def test_forced_flex_matches_the_reference_forward(method, options, causal, n):
    module = _module(method, options)
    q, k, v = qkv(h=HEADS, n=n, d=HEAD_DIM, dv=5)
    mask = padding(q.shape[0], n)
    with torch.no_grad(), strategy.force(banded="flex"):
        out = module(q, k, v, causal=causal, key_padding_mask=mask)
    ref = module.spec.reference(module, q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, ref)


SOFTMAX_CASES = [
    ({"causal": True, "sliding_window": 9}, {}),
    ({"causal": True}, {"softcap": 2.0}),
    ({"causal": False}, {"softcap": 2.0}),
    ({"causal": True, "sliding_window": 9, "sinks": True}, {"softcap": 2.0}),
    ({"causal": False, "sinks": True}, {}),
]


@pytest.mark.parametrize(("call", "build"), SOFTMAX_CASES)
def test_flex_serves_softmax_window_softcap_and_sinks(device, call, build):
    module = effattn.build("softmax", head_dim=HEAD_DIM, heads=HEADS, **build)
    call = dict(call)
    if call.pop("sinks", False):
        call["sinks"] = torch.linspace(-1.0, 2.0, HEADS, dtype=torch.float64, device=device)
    _check_against_reference(device, module, call, scale=2.0)


def test_forced_flex_runs_the_window_hybrid():
    module = effattn.build("linear", head_dim=HEAD_DIM, heads=HEADS, window=8).eval()
    q, k, v = qkv(h=HEADS, n=63, d=HEAD_DIM)
    mask = padding(q.shape[0], 63)
    for causal in (False, True):
        with torch.no_grad():
            cpu = module(q, k, v, causal=causal, key_padding_mask=mask)
            with strategy.force(banded="flex"):
                out = module(q, k, v, causal=causal, key_padding_mask=mask)
        torch.testing.assert_close(out, cpu)


def test_empty_rows_give_zero_and_minus_infinity():
    """The log-sum-exp contract: natural log; a row that sees no key gives out = 0, lse = -inf
    (FlexAttention's answer, not fixed up)."""
    q, k, v = qkv(b=2, n=63)
    mask = torch.zeros(2, 63, dtype=torch.bool)
    mask[0, :40] = True  # rows 0 .. 35 of a causal band of 5 see only padding
    pieces = [Band(4, 0)]
    with torch.no_grad(), strategy.force(banded="flex"):
        out, lse = sparse_attention(q, k, v, pieces, scale=0.5, key_mask=mask)
    ref, ref_lse = sparse_attention(q, k, v, pieces, scale=0.5, key_mask=mask)
    assert torch.isneginf(lse[0, :, :36]).all() and (out[0, :, :36] == 0).all()
    assert torch.isfinite(lse[:, :, 40:]).all()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    # Natural log: exp(lse) is the row's sum of exp(scale q.k) over its band.
    s = 0.5 * q[1, 0] @ k[1, 0].T
    i, j = torch.arange(63)[:, None], torch.arange(63)[None, :]
    dense = s.masked_fill(~((i - j >= 0) & (i - j <= 4)), -math.inf).logsumexp(-1)
    torch.testing.assert_close(lse[1, 0], dense)


@pytest.mark.parametrize(("d", "dv"), [(5, 3), (21, 7), (7, 21), (16, 16)])
def test_narrow_heads_are_widened_exactly(d, dv):
    """Head dims under 16 (which the compiled CUDA kernel refuses) go in widened with zero
    columns and come out cut back: the same output and lse as the unwidened eager call (which
    the CPU runs), the output contiguous and as wide as v."""
    q, k, v = qkv(b=2, n=63, d=d, dv=dv)
    mask = padding(2, 63)
    pieces = [Band(6, 2), Globals(torch.tensor([5, 40]))]
    with torch.no_grad(), strategy.force(banded="flex"):
        out, lse = sparse_attention(q, k, v, pieces, scale=0.3, key_mask=mask)
        narrow, narrow_lse = flex_strategy._attend(q, k, v, pieces, scale=0.3, key_mask=mask,
                                                   softcap=None)
    assert out.shape == (2, HEADS, 63, dv) and out.is_contiguous()
    torch.testing.assert_close(out, narrow, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, narrow_lse, rtol=1e-12, atol=1e-12)
    assert flex_strategy.widened(q).shape[-1] == max(d, flex_strategy.MIN_HEAD_DIM)


def test_refusals_are_shared_by_the_strategies():
    q, k, v = qkv(n=32)
    for forced in ("cpu", "flex"):
        with strategy.force(banded=forced), torch.no_grad():
            with pytest.raises(ValueError, match="softcap"):
                sparse_attention(q, k, v, [Band(2, 2), Globals(torch.tensor([0]))], scale=1.0,
                                 softcap=3.0)
            with pytest.raises(ValueError, match="softcap"):
                sparse_attention(q, k, v, [Blocks(None, 8), Summary(8, 2)], scale=1.0,
                                 softcap=3.0)
            with pytest.raises(ValueError, match="at most one Globals"):
                sparse_attention(q, k, v, [Globals(torch.tensor([0])), Globals(torch.tensor([1]))],
                                 scale=1.0)
            with pytest.raises(ValueError, match="dilation >= 1"):
                sparse_attention(q, k, v, [Band(2, 2, 0)], scale=1.0)
            with pytest.raises(ValueError, match="key_blocks must have shape"):
                sparse_attention(q, k, v, [Blocks(torch.zeros(3, 1, dtype=torch.long), 8)],
                                 scale=1.0)
            with pytest.raises(TypeError, match="not a piece"):
                sparse_attention(q, k, v, [Columns(4), "band"], scale=1.0)
            # Every piece is defined over aligned positions: no cross-attention (M != N).
            with pytest.raises(ValueError, match="aligned positions"):
                sparse_attention(q, k[:, :, :20], v[:, :, :20], [Band(2, 2)], scale=1.0)


def test_forced_flex_on_the_cpu_refuses_gradients_clearly():
    q, k, v = qkv(n=32)
    q.requires_grad_()
    with strategy.force(banded="flex"), pytest.raises(NotImplementedError,
                                                      match="inference only"):
        sparse_attention(q, k, v, [Band(3, 3)], scale=1.0)


def _check_against_reference(device, module, call, n=129, scale=1.0):
    """On CUDA the compiled kernel (the default strategy there), fp32 against the float64
    reference, outputs and gradients; on the CPU the eager form's forward (no backward there)."""
    module = module.to(device)
    q, k, v = (x.to(device) for x in qkv(h=HEADS, n=n, d=HEAD_DIM, dtype=torch.float32,
                                         scale=scale))
    mask = padding(q.shape[0], n).to(device)
    ref_inputs = [x.double().requires_grad_() for x in (q, k, v)]
    ref = module.spec.reference(module, *ref_inputs, key_padding_mask=mask, **call)
    call = {key: value.float() if torch.is_tensor(value) else value
            for key, value in call.items()}
    if device.type != "cuda":
        with torch.no_grad(), strategy.force(banded="flex"):
            out = module(q, k, v, key_padding_mask=mask, **call)
        torch.testing.assert_close(out.double(), ref.detach(), atol=2e-5, rtol=1e-4)
        return
    assert strategy.choose("banded", device) == "flex"
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = module(*inputs, key_padding_mask=mask, **call)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-4, rtol=1e-3)
    for got, want in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize(("method", "options", "causal"), CASES, ids=IDS)
def test_flex_kernel_matches_the_reference_outputs_and_gradients(device, method, options,
                                                                 causal):
    _check_against_reference(device, _module(method, options), {"causal": causal})


def test_float64_on_cuda_stays_on_the_banded_engine():
    """FlexAttention's compiled kernel has no float64 form: on CUDA (where flex is the default)
    float64 goes to the banded engine, every other dtype to flex; the CPU keeps its choice."""
    from effattn.sparse.blockwise import runs_flex

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    if strategy.choose("banded", cuda) != "flex":
        pytest.skip("this torch has no FlexAttention: flex is not CUDA's default")
    assert not runs_flex(cuda, torch.float64)
    assert runs_flex(cuda, torch.float32) and runs_flex(cuda, torch.bfloat16)
    assert effattn.sparse.engine_dtype(torch.float64, cuda) == torch.float64
    with strategy.force(banded="flex"):
        assert runs_flex(cpu, torch.float64)
    assert not runs_flex(cpu, torch.float32)


def test_flex_takes_half_precision_as_it_is():
    """FlexAttention keeps the softmax statistics in fp32 itself: banded methods hand it bf16
    as it is (the CPU engine gets fp32), and the output stays close to the reference."""
    cpu = torch.device("cpu")
    assert effattn.sparse.engine_dtype(torch.bfloat16, cpu) == torch.float32
    with strategy.force(banded="flex"):
        assert effattn.sparse.engine_dtype(torch.bfloat16, cpu) == torch.bfloat16
    module = _module("local", {"window": 16})
    q, k, v = qkv(h=HEADS, n=129, d=HEAD_DIM)
    with torch.no_grad(), strategy.force(banded="flex"):
        out = module(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert out.dtype == torch.bfloat16
    ref = module.spec.reference(module, q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_one_tensor_passed_twice_after_distinct_ones():
    """torch 2.13's flex_attention fails (IndexError in dynamo's aliasing-guard report) when q
    is passed as k after a call with distinct tensors and another mask; the strategy passes
    distinct views."""
    q = torch.randn(1, HEADS, 64, HEAD_DIM)
    with torch.no_grad(), strategy.force(banded="flex"):
        _module("bigbird", {"block_size": 8})(q, q.clone(), q.clone())
        out = _module("sparse-strided", {"stride": 7})(q, q, q, causal=True)
        ref = _module("sparse-strided", {"stride": 7}).spec.reference(
            _module("sparse-strided", {"stride": 7}), q, q, q, causal=True)
    torch.testing.assert_close(out, ref)


def test_inside_torch_compile_the_chosen_strategy_runs():
    """An outer torch.compile(fullgraph=True) traces the chosen strategy: FlexAttention where
    flex is the strategy, the blockwise engine where it is not (tests/test_flex_compile.py has
    the BlockMask cache under compile and inductor's kernel)."""
    module = _module("local", {"window": 8})
    q, k, v = qkv(h=HEADS, n=40, d=HEAD_DIM)
    for forced in ("cpu", "flex"):
        torch._dynamo.reset()
        backend = CompileCounterWithBackend("aot_eager")
        with strategy.force(banded=forced):
            out = torch.compile(module, backend=backend, fullgraph=True)(q, k, v, causal=True)
        torch._dynamo.reset()
        targets = [node.target for node in backend.graphs[0].graph.nodes]
        assert (torch.ops.higher_order.flex_attention in targets) == (forced == "flex")
        torch.testing.assert_close(out, module.spec.reference(module, q, k, v, causal=True))


@pytest.mark.slow
def test_every_rule_compiles_into_a_flex_kernel():
    """The rules are FlexAttention-compilable (elementwise arithmetic and gathers from small
    tables): inductor's CPU kernel (forward, no lse: all torch 2.13 compiles on the CPU) over
    a union of every kind of piece, per-head key blocks with a block pattern, with the soft cap
    and padding score_mod, equals the dense masked softmax."""
    n, c = 100, 8
    nq = -(-n // c)
    gen = torch.Generator().manual_seed(0)
    key_blocks = torch.stack([torch.randperm(nq, generator=gen)[:3] for _ in range(HEADS * nq)])
    key_blocks = key_blocks.view(HEADS, nq, 3)
    key_blocks[:, 0, 2] = -1
    pattern = torch.rand(c, 3 * c, generator=gen) < 0.7
    pieces = [Band(5, 3, 2), Blocks(key_blocks, c, pattern), Columns(7, True), Summary(9, 2),
              Globals(torch.tensor([4, 50]))]
    q, k, v = qkv(h=HEADS, n=n, d=HEAD_DIM, dtype=torch.float32)
    mask = padding(q.shape[0], n)
    blocks = flex_strategy.block_mask(pieces, HEADS, n, torch.device("cpu"))
    modify = flex_strategy.score_mod(3.0, mask)
    torch._dynamo.reset()
    kernel = torch.compile(flex_api.flex_attention, dynamic=False)
    out = kernel(q, k, v, score_mod=modify, block_mask=blocks, scale=0.5)
    torch._dynamo.reset()
    allowed = dense_mask(pieces, HEADS, n) & ~mask[:, None, None, :]
    scores = 3.0 * torch.tanh(0.5 * q @ k.transpose(-2, -1) / 3.0)
    ref = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0) @ v
    # A wrong mask shows as errors of 1e-2 and more (rows of a few tens of keys); the compiled
    # kernel's rounding differed from the reference by up to 1.4e-4 in one of five runs.
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


def test_compiled_branch_records_the_first_calls_time(monkeypatch):
    """The CUDA branch (compiled kernel, first-call timing), run on the CPU with the eager form
    standing in for the compiled kernel: its first call per shape is timed into
    COMPILE_SECONDS, later calls are not, and the answer is the eager branch's."""
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs["block_mask"])
        return flex_api.flex_attention(*args, **kwargs)

    monkeypatch.setattr(flex_strategy, "compiled_on", lambda device: True)
    monkeypatch.setattr(flex_strategy, "_kernel", lambda: stand_in)
    monkeypatch.setattr(flex_strategy, "COMPILE_SECONDS", {})
    q, k, v = qkv(n=63)
    with torch.no_grad(), strategy.force(banded="flex"):
        out, lse = sparse_attention(q, k, v, [Band(4, 4, 2)], scale=0.5, softcap=2.0)
        sparse_attention(q, k, v, [Band(4, 4, 2)], scale=0.5, softcap=2.0)
        assert len(flex_strategy.COMPILE_SECONDS) == 1
        sparse_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], [Band(4, 4, 2)], scale=0.5)
    assert len(flex_strategy.COMPILE_SECONDS) == 2
    assert all(seconds > 0 for seconds in flex_strategy.COMPILE_SECONDS.values())
    assert len(calls) == 3 and calls[0] is calls[1]  # the cached BlockMask
    ref, ref_lse = sparse_attention(q, k, v, [Band(4, 4, 2)], scale=0.5, softcap=2.0)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_a_shape_without_a_kernel_in_shared_memory_compiles_with_smaller_tiles(monkeypatch):
    """Inductor's "out of resource" on the first call of a shape (as bigbird's on an H200): a
    warning, then the same call with SMALL_TILES, which that shape keeps. Any other failure, or
    one with the small tiles too, is raised as it is."""
    seen = []

    def stand_in(*args, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        if kernel_options is None:
            try:
                raise RuntimeError("OutOfMemoryError: out of resource: triton_tem_fused_flex_0 "
                                   "Required: 311296 Hardware limit: 232448")
            except RuntimeError as error:
                raise RuntimeError("No valid triton configs.") from error
        return flex_api.flex_attention(*args, **kwargs)

    monkeypatch.setattr(flex_strategy, "compiled_on", lambda device: True)
    monkeypatch.setattr(flex_strategy, "_kernel", lambda: stand_in)
    monkeypatch.setattr(flex_strategy, "COMPILE_SECONDS", {})
    monkeypatch.setattr(flex_strategy, "SMALL_TILE_SHAPES", set())
    q, k, v = qkv(n=63)
    with torch.no_grad(), strategy.force(banded="flex"):
        with pytest.warns(UserWarning, match="smaller ones"):
            out, lse = sparse_attention(q, k, v, [Band(4, 4, 1)], scale=0.5)
        sparse_attention(q, k, v, [Band(4, 4, 1)], scale=0.5)
    small = flex_strategy.SMALL_TILES
    assert seen == [None, small, small]
    assert len(flex_strategy.SMALL_TILE_SHAPES) == 1
    ref, ref_lse = sparse_attention(q, k, v, [Band(4, 4, 1)], scale=0.5)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)

    def failing(*args, kernel_options=None, **kwargs):
        raise RuntimeError("out of resource" if kernel_options else "something else")

    monkeypatch.setattr(flex_strategy, "_kernel", lambda: failing)
    with torch.no_grad(), strategy.force(banded="flex"):
        with pytest.raises(RuntimeError, match="something else"):
            sparse_attention(q[:, :, :50], k[:, :, :50], v[:, :, :50], [Band(4, 4, 1)],
                             scale=0.5)
        with pytest.raises(RuntimeError, match="out of resource"):  # the small tiles' own
            sparse_attention(q, k, v, [Band(4, 4, 1)], scale=0.5)


def test_a_torch_without_flex_attention_keeps_the_blockwise_engine(monkeypatch):
    find_spec = strategy.importlib.util.find_spec
    monkeypatch.setattr(strategy.importlib.util, "find_spec",
                        lambda name: None if "flex_attention" in name else find_spec(name))
    strategy._runs_here.cache_clear()
    try:
        with strategy.force():
            if not strategy.forced():
                assert strategy.choose("banded", torch.device("cuda")) == "cpu"
        with strategy.force(banded="flex"):
            assert strategy.choose("banded", torch.device("cuda")) == "flex"
    finally:
        strategy._runs_here.cache_clear()
