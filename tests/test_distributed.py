"""effattn.distributed: sequence-parallel attention equals one process on the whole sequence.

One spawn of 4 gloo workers on CPU runs every case in order, on all 4 ranks and then on a
group of 2 (starting processes costs far more than the cases); each worker writes its verdict per
case, and one test per case reads them. Error cases run first: one that left the ranks out of
step would hang the cases after it, which the collective timeout and the join deadline turn
into failures.
"""

import datetime
import json
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import effattn
from effattn.distributed import SequenceParallel

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

TIMEOUT = 30  # seconds, for every collective in the workers
# Seconds for the workers to run every case (about 15 on two quiet cores): a guard against a
# hang, not a speed limit. A case that fails on one rank only leaves the others waiting in a
# collective that gloo does not time out, so this is also how long such a failure takes to show.
DEADLINE = 300
B, H, D, DV = 2, 2, 7, 5

# (id, method, options, dtype): every method that can be split, with the variants that change
# the strategy (log-scale stabiliser or none, eps of sign-changing features, learned sigma or
# feature maps, gate, softmax's soft cap, sliding window and sinks, window within or beyond a
# slice; the kernelized window hybrid, its window within or beyond a slice, gated, with its
# factor). Checked in fp32 to 1e-5, except FAVOR's trigonometric maps: their denominators cancel
# (unbounded variance), so one process's fp32 result is itself uncertain beyond 1e-5; they are
# checked in float64 to 1e-10. rfa needs F = 128 for the same reason in fp32.
METHODS = [
    ("performer", "performer", {"num_features": 16}, torch.float32),
    ("performer-trig", "performer", {"num_features": 16, "feature_map": "trig"}, torch.float64),
    ("favor", "favor", {"num_features": 16}, torch.float64),
    ("rfa", "rfa", {"num_features": 128, "learn_sigma": True}, torch.float32),
    ("rfa-gated", "rfa", {"num_features": 128, "gated": True}, torch.float32),
    ("linear", "linear", {}, torch.float32),
    ("hedgehog", "hedgehog", {"num_features": 9}, torch.float32),
    ("hedgehog-softmax_dim", "hedgehog", {"feature_map": "softmax_dim"}, torch.float32),
    ("taylor", "taylor", {"proj_dim": 4}, torch.float32),
    ("softmax", "softmax", {}, torch.float32),
    ("softmax-softcap", "softmax", {"softcap": 2.0}, torch.float32),
    ("softmax-window-sinks", "softmax", {}, torch.float32),
    ("performer-window", "performer", {"num_features": 16, "window": 4}, torch.float32),
    ("rfa-gated-window", "rfa", {"num_features": 128, "gated": True, "window": 9},
     torch.float32),
    ("hedgehog-window-factor", "hedgehog", {"num_features": 9, "window": 9,
                                            "window_factor": True}, torch.float32),
    ("local", "local", {"window": 5}, torch.float32),
    ("local-wide-dilated", "local", {"window": 17, "dilation": 2}, torch.float32),
]
# (id, ragged): the even split N = 6 P without a mask, and N = 6 P + 3 with total_length and
# ragged padding (batch 0: the first slice and one more token, batch 1: the last 3 tokens).
SPLITS = [("even", False), ("ragged", True)]
# Call inputs besides the gate, by id: softmax's causal sliding window of 7 (past a slice of 6)
# and its sinks (H,), replicated on every rank, so their gradient is summed like a parameter's.
CALLS = {"softmax-window-sinks": {"sliding_window": 7, "sinks": True}}
EQUAL = {f"{key}-{'causal' if causal else 'full'}-{split}":
         (name, opts, dtype, causal, ragged, CALLS.get(key, {}))
         for key, name, opts, dtype in METHODS
         for causal in (False, True) if causal or not (opts.get("gated") or key in CALLS)
         for split, ragged in SPLITS}
ERRORS = ["uneven-without-length", "length-mismatch", "seeds-differ", "one-rank-bad-input",
          "ranks-disagree", "windows-differ"]
BYTES = ["performer-bytes-independent-of-n"]
REDRAW = "rfa-training-redraws"
CASES = [*ERRORS, *EQUAL, REDRAW, *BYTES]


def _build(name, opts, seed=0):
    attn = effattn.build(name, head_dim=D, heads=H, seed=seed, **opts)
    if hasattr(attn, "chunk_size"):
        attn.chunk_size = 4  # slices span several chunks
        attn.slice_elements = 200  # and several slices of the core
    return attn.eval()


def _inputs(n, world, ragged=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    gate = torch.rand(B, H, n, generator=g, dtype=dtype) * 0.6 + 0.2
    weight = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    mask = None
    if ragged:
        mask = torch.zeros(B, n, dtype=torch.bool)
        mask[0, : -(-n // world) + 1] = True
        mask[1, -3:] = True
    return q, k, v, gate, weight, mask


def _close(actual, expected, what):
    # Not torch.testing.assert_close: with a process group up it imports DTensor (seconds).
    tol = 1e-5 if actual.dtype == torch.float32 else 1e-10
    excess = ((actual - expected).abs() - tol * (1 + expected.abs())).max().item()
    assert actual.shape == expected.shape and excess <= 0, f"{what}: off by {excess:.3g} + tol"


def _equal_case(group, name, opts, dtype, causal, ragged, calls):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = 6 * world + (3 if ragged else 0)
    attn = _build(name, opts).to(dtype)
    q, k, v, gate, weight, mask = _inputs(n, world, ragged, dtype)
    gate = gate if opts.get("gated") else None
    inputs = [t.requires_grad_() for t in (q, k, v) + (() if gate is None else (gate,))]
    shared = {}
    if calls.get("sinks"):
        shared["sinks"] = torch.linspace(-1.0, 1.0, H, dtype=dtype).requires_grad_()
    params = [*shared.values(), *(p for p in attn.parameters() if p.requires_grad)]
    window = {key: value for key, value in calls.items() if key == "sliding_window"}
    extra = {**shared, **window, **({} if gate is None else {"gate": gate})}
    full = attn(q, k, v, causal=causal, key_padding_mask=mask, **extra)
    grads = torch.autograd.grad((full * weight).sum(), inputs + params)

    def part(t, dim=2):
        return None if t is None else t.detach().tensor_split(world, dim)[rank]

    local = [part(t).requires_grad_() for t in inputs]
    extra = {**shared, **window, **({} if gate is None else {"gate": local[3]})}
    out = SequenceParallel(attn, group)(*local[:3], causal=causal, key_padding_mask=part(mask, 1),
                                        total_length=n if ragged else None, **extra)
    local_grads = torch.autograd.grad((out * part(weight)).sum(), local + params)
    _close(out, part(full), "output")
    for arg, got, want in zip("qkvg", local_grads[: len(local)], grads, strict=False):
        _close(got, part(want), f"grad {arg}")
    for got, want in zip(local_grads[len(local):], grads[len(inputs):], strict=True):
        dist.all_reduce(got, group=group)  # each rank holds its slice's share of the gradient
        _close(got, want, "parameter grad")
    if window:
        # Inputs that record no gradient: an int call input is no tensor to ask about it.
        plain = {key: value.detach() for key, value in shared.items()}
        out = SequenceParallel(attn, group)(*(t.detach() for t in local[:3]), causal=causal,
                                            key_padding_mask=part(mask, 1),
                                            total_length=n if ragged else None, **plain, **window)
        _close(out, part(full), "output without gradients")


def _redraw_case(group):
    """Training mode redraws rfa's features every call: the ranks redraw in step."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    single = _build("rfa", {"num_features": 16}).train()
    parallel = SequenceParallel(_build("rfa", {"num_features": 16}).train(), group)
    q, k, v, *_ = _inputs(6 * world, world)
    for _ in range(3):
        full = single(q, k, v, causal=True)
        out = parallel(*(t.tensor_split(world, 2)[rank] for t in (q, k, v)), causal=True)
    _close(out, full.tensor_split(world, 2)[rank], "third call")
    assert parallel.attn.get_extra_state()["calls"] == 3


def _error_case(group, case):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = 6 * world
    q, k, v, *_ = _inputs(n, world)
    seed = rank if case == "seeds-differ" else 0
    sp = SequenceParallel(_build("performer", {"num_features": 16}, seed=seed), group)
    local = [t.tensor_split(world, 2)[rank] for t in (q, k, v)]
    kwargs, expected = {}, None
    if case == "uneven-without-length":
        local = [t[:, :, 1:] if rank == 0 else t for t in local]
        expected = "uneven slices need total_length"
    elif case == "length-mismatch":
        kwargs, expected = {"total_length": n + 1}, "tensor_split"
    elif case == "seeds-differ":
        expected = "random features must be identical"
    elif case == "one-rank-bad-input":
        if rank == world - 1:
            local[0] = local[0][:, :1]
        expected = "heads" if rank == world - 1 else rf"rank\(s\) \[{world - 1}\] rejected"
    elif case == "ranks-disagree":
        kwargs, expected = {"causal": rank == 0}, "disagree on causal"
    elif case == "windows-differ":
        # An int call input decides the pattern: the ranks must agree on its value.
        sp = SequenceParallel(_build("softmax", {}), group)
        kwargs, expected = {"causal": True, "sliding_window": 5 + rank}, "disagree on call_inputs"
    with pytest.raises(ValueError, match=expected):
        sp(*local, **kwargs)


def _bytes_case(group):
    """Bytes this rank hands to collectives for performer, forward and backward: the same at
    N = 8 P and N = 64 P, causal or not (only the fixed-size states travel)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sent = []
    originals = dist.all_reduce, dist.all_gather

    def counting(original):
        def call(output, tensor=None, *args, **kwargs):
            sent.append(output if tensor is None else tensor)
            return original(output, *(() if tensor is None else (tensor,)), *args, **kwargs)
        return call

    sp = SequenceParallel(_build("performer", {"num_features": 16}), group)
    totals = {}
    dist.all_reduce = counting(originals[0])
    dist.all_gather = counting(originals[1])
    try:
        for causal in (False, True):
            for n in (8 * world, 64 * world):
                q, k, v, *_ = _inputs(n, world)
                local = [t.tensor_split(world, 2)[rank].requires_grad_() for t in (q, k, v)]
                sent.clear()
                sp(*local, causal=causal).sum().backward()
                totals[causal, n] = sum(t.numel() * t.element_size() for t in sent)
    finally:
        dist.all_reduce, dist.all_gather = originals
    for causal in (False, True):
        assert totals[causal, 8 * world] == totals[causal, 64 * world] > 0, totals


def _run(group, case):
    if case in ERRORS:
        _error_case(group, case)
    elif case in EQUAL:
        _equal_case(group, *EQUAL[case])
    elif case == REDRAW:
        _redraw_case(group)
    else:
        _bytes_case(group)


def _worker(rank, world, init_file, out_dir):
    """All cases on the whole group of 4, then on a subgroup of ranks 0 and 1 (which also
    checks group=); one json of verdicts per rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT))
    pair = dist.new_group([0, 1])
    verdicts = {}
    try:
        for size, group in ((world, None), (2, pair)):
            if rank >= size:
                continue
            for case in CASES:
                try:
                    _run(group, case)
                    verdicts[f"{size}/{case}"] = None
                except Exception:  # noqa: BLE001  (reported per case by the parent)
                    verdicts[f"{size}/{case}"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(verdicts, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """{"P/case": [each rank's traceback, or None]} from one spawn of 4 workers."""
    out = tmp_path_factory.mktemp("workers")
    context = mp.start_processes(_worker, args=(4, str(out / "init"), str(out)),
                                 nprocs=4, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the workers did not finish within {DEADLINE} s")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {key: [verdict[key] for verdict in ranks if key in verdict]
            for key in (f"{p}/{case}" for p in (2, 4) for case in CASES)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [2, 4], ids=lambda p: f"P={p}")
def test_case_on_every_rank(verdicts, world, case):
    results = verdicts[f"{world}/{case}"]
    failed = [(r, tb) for r, tb in enumerate(results) if tb is not None]
    assert len(results) == world and not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed)


def test_needs_an_initialised_group():
    sp = SequenceParallel(effattn.build("performer", head_dim=D, heads=H, seed=0))
    q = torch.randn(B, H, 4, D)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sp(q, q, q)


@pytest.mark.parametrize("name", ["nystrom", "linformer", "longformer", "bigbird", "reformer",
                                  "sparse-strided", "random", "fnet"])
def test_methods_that_need_the_whole_sequence_are_refused(name):
    attn = effattn.build(name, head_dim=8, heads=1, max_len=64)
    with pytest.raises(ValueError, match=f"{name} cannot be split along the sequence"):
        SequenceParallel(attn)


def test_wraps_only_built_modules():
    with pytest.raises(ValueError, match="attn must be a module"):
        SequenceParallel(torch.nn.Linear(2, 2))
