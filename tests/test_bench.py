"""effattn bench: CLI end to end, resume, failure statuses, argument errors, and the pieces
(timing summary, peak memory, FLOP models, crossover, result store)."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_png, load_results

import effattn
from effattn.cli import main
from effattn.tools.bench import flops, results, speed, timing
from effattn.tools.bench.speed import Config, precheck

# No retries: the disturbance verdict is tested on fake timings (test_timing.py); here a busy
# machine would only make the test slower.
TINY = ["--lengths", "32", "--heads", "2", "--head-dim", "16", "--repeats", "2", "--warmup", "0",
        "--retries", "0"]


def _other_method():
    """A registered method besides softmax, preferring cheap linear ones (None if only softmax)."""
    names = effattn.methods()
    for name in ("linear", "performer", "favor", "rfa", "local", "nystrom"):
        if name in names:
            return name
    return next((n for n in names if n != "softmax"), None)


def _methods_arg():
    other = _other_method()
    return "softmax" if other is None else f"softmax,{other}"


def test_cli_end_to_end_writes_results_plots_and_resumes(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--methods", _methods_arg(), *TINY, "--out", str(out)]
    assert main([*args, "--vs-flops"]) == 0
    printed = capsys.readouterr().out
    n_methods = len(_methods_arg().split(","))
    assert f"{2 * n_methods} configurations measured, 0 already" in printed
    assert "median time per call (ms), fwd" in printed and "effective GFLOP/s" in printed

    records = load_results(out)
    assert len(records) == 2 * n_methods
    assert {r["pass"] for r in records} == {"fwd", "fwdbwd"}
    for r in records:
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["iqr_ms"] >= 0 and r["peak_mib"] >= 0
        assert r["samples"] == 2
    soft = [r for r in records if r["method"] == "softmax"]
    assert all(r["gflops"] > 0 for r in soft)
    fwd = next(r for r in soft if r["pass"] == "fwd")
    assert fwd["flops"] == 2 * 2 * 32 * 32 * (16 + 16)
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and rows[0]["method"] and rows[0]["status"] == "ok"
    for png in ("time.png", "memory.png", "gflops.png"):
        assert_png(out / png)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["matmul_peak_gflops"]["float32"] > 0
    assert set(summary["crossover"]) == {"fwd", "fwdbwd"}
    machine = summary["machine"]
    assert machine["matmul_peak_gflops"]["float32"] > 0
    assert machine["matmul_peak_gflops"]["bfloat16"] > 0 and machine["reference_ms"] > 0
    assert "vector_extensions" in machine and "cpu_model" in machine
    assert "machine: " in printed and "matmul peak float32" in printed
    for r in records:  # the verdict, whatever the machine's load was
        assert isinstance(r["disturbed"], bool) and r["slowdown"] >= 1 and r["attempts"] == 1
        assert r["cpu"]

    # Rerunning the same command measures only what was disturbed, and leaves the rest untouched.
    clean = [r for r in records if not r["disturbed"]]
    assert main(args) == 0
    n_clean = len(clean)
    assert (f"{2 * n_methods - n_clean} configurations measured, {n_clean} already"
            in capsys.readouterr().out)
    records = load_results(out)
    assert [r for r in records if r in clean] == clean

    # A record that is missing (an interrupted sweep) is measured again.
    (out / "results.json").write_text(json.dumps(records[1:]))
    assert main(args) == 0
    n_kept = sum(not r["disturbed"] for r in records[1:])
    assert (f"{2 * n_methods - n_kept} configurations measured, {n_kept} already"
            in capsys.readouterr().out)
    again = load_results(out)
    assert len(again) == 2 * n_methods
    kept = {r["timestamp"] for r in records[1:] if not r["disturbed"]}
    assert kept <= {r["timestamp"] for r in again}


def test_a_slow_first_call_is_set_up_when_the_second_is_fast(monkeypatch):
    # A GPU library can build its kernel for a new shape inside the first call; only a second
    # call that is slow too makes the configuration "too slow".
    calls = []

    def first_slow(call, clock):
        calls.append(real(call, clock))
        return 10.0 if len(calls) == 1 else calls[-1]

    real = speed.time_once
    monkeypatch.setattr(speed, "time_once", first_slow)
    cfg = Config("softmax", 32, "fwd", heads=2, head_dim=16)
    result = speed.measure(cfg, speed.Settings(repeats=2, warmup=0, max_seconds=5.0, retries=0))
    assert result["status"] == "ok" and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(speed, "time_once", lambda call, clock: calls.append(1) or 10.0)
    result = speed.measure(cfg, speed.Settings(repeats=2, warmup=0, max_seconds=5.0, retries=0))
    assert result["status"].startswith("too slow: one call took 10 s") and len(calls) == 2


def test_too_slow_is_recorded_and_larger_lengths_skipped(tmp_path, capsys):
    out = tmp_path / "slow"
    assert main(["bench", "--methods", "softmax", *TINY, "--lengths", "16,32",
                 "--max-seconds", "1e-9", "--out", str(out)]) == 0
    status = {(r["length"], r["pass"]): r["status"] for r in load_results(out)}
    assert status[(16, "fwd")].startswith("too slow: one call took")
    assert status[(16, "fwdbwd")] == "skipped: too slow at N=16"
    assert status[(32, "fwd")] == status[(32, "fwdbwd")] == "skipped: too slow at N=16"
    assert "too slow" in capsys.readouterr().out


def test_timeout_is_recorded_not_raised(tmp_path):
    out = tmp_path / "timeout"
    assert main(["bench", "--methods", "softmax", *TINY, "--lengths", "16,32", "--passes", "fwd",
                 "--timeout", "0.001", "--out", str(out)]) == 0
    status = {r["length"]: r["status"] for r in load_results(out)}
    assert status[16].startswith("timeout: no result within")
    assert status[32] == "skipped: timeout at N=16"


def test_memory_cap_records_oom(tmp_path):
    # The output alone is 4 * 8 * 512 * 64 * 4 bytes = 4 MiB, over a 1 MiB cap.
    out = tmp_path / "oom"
    assert main(["bench", "--methods", "softmax", "--lengths", "512", "--batch", "4",
                 "--passes", "fwd", "--repeats", "1", "--max-memory", "1", "--out", str(out)]) == 0
    (record,) = load_results(out)
    assert record["status"].startswith("oom"), record


def test_causal_refusal_is_recorded_without_running():
    non_causal = [m for m in effattn.methods() if not effattn.spec(m).causal]
    if not non_causal:
        pytest.skip("no non-causal method registered")
    name = non_causal[0]
    status = precheck(Config(method=name, length=64, pass_name="fwd", causal=True))
    assert status == f"refused: {effattn.spec(name).refusals['causal']}"
    assert precheck(Config(method="softmax", length=64, pass_name="fwd", causal=True)) is None


@pytest.mark.parametrize("bad, message", [
    (["--methods", "softmax,nope"], "unknown method(s) nope"),
    (["--lengths", "-5"], "lengths must be positive"),
    (["--lengths", "0"], "lengths must be positive"),
    (["--lengths", "12x"], "bad length '12x'"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--passes", "fwd,back"], "passes must be a comma list"),
    (["--heads", "0"], "expected a positive integer"),
    (["--option", "num_features"], "expected key=value"),
    (["--retries", "-1"], "expected a non-negative integer"),
])
def test_bad_arguments_exit_2_with_message(bad, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *bad, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_option_unknown_to_every_method_exits_2(tmp_path, capsys):
    assert main(["bench", "--methods", "softmax", "--option", "num_features=8",
                 "--out", str(tmp_path)]) == 2
    assert "'num_features' is not an option of any of softmax" in capsys.readouterr().err


def test_timing_median_and_iqr():
    t = timing.Timing((4.0, 1.0, 3.0, 2.0, 5.0), number=1)
    assert t.median == 3.0 and t.iqr == 2.0
    calls = []
    result = timing.time_fn(lambda: calls.append(1), repeats=3, warmup=2, min_block_s=0.0)
    assert len(result.samples) == 3 and result.number == 1 and len(calls) == 2 + 3
    with pytest.raises(ValueError, match="repeats"):
        timing.time_fn(lambda: None, repeats=0)


_PROBE = """
import torch
from effattn.tools.bench.memory import MiB, PeakMemory
torch.ones(16)
with PeakMemory("cpu") as big:
    x = torch.ones(48 * MiB // 4)  # 48 MiB, touched
    del x
with PeakMemory("cpu") as small:
    torch.ones(16)
print(big.peak_bytes / MiB, small.peak_bytes / MiB)
"""


def test_peak_memory_sees_a_known_allocation():
    # In a fresh process, as the sweep measures: a long-lived process may hold freed memory that
    # a new allocation reuses without raising the mark.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env=env, check=True)
    big, small = map(float, res.stdout.split())
    assert 40 <= big <= 80
    assert small < 8


def test_flop_models():
    kw = dict(batch=2, heads=3, n=100, m=100, head_dim=16, value_dim=16)
    assert flops.forward_flops("softmax", {}, causal=False, **kw) == 2 * 2 * 3 * 100 * 100 * 32
    causal = flops.forward_flops("softmax", {}, causal=True, **kw)
    assert causal == 2 * 2 * 3 * (100 * 101 / 2) * 32
    plain = flops.forward_flops("performer", {"num_features": 64}, causal=False, **kw)
    assert plain == 2 * 2 * 3 * (200 * 64 * 16 + 200 * 64 * 17)

    class Doubled(torch.nn.Module):
        feature_dim = 128  # e.g. sin/cos features of 64 projections

    doubled = flops.forward_flops("rfa", {"num_features": 64}, causal=False, module=Doubled(),
                                  **kw)
    assert doubled == 2 * 2 * 3 * (200 * 64 * 16 + 200 * 128 * 17)
    assert flops.forward_flops("linear", {}, causal=False, **kw) == 2 * 2 * 3 * 200 * 16 * 17
    assert flops.forward_flops("reformer", {}, causal=False, **kw) is None
    assert flops.pass_flops(10.0, "fwdbwd") == 30.0 and flops.pass_flops(None, "fwd") is None


def _rec(method, length, ms, status="ok", pass_name="fwd"):
    return {"method": method, "length": length, "pass": pass_name, "status": status,
            "median_ms": ms if status == "ok" else None, "peak_mib": 1.0}


def test_crossover_is_the_length_from_which_on_a_method_wins():
    records = [
        _rec("softmax", 256, 1.0), _rec("softmax", 512, 4.0), _rec("softmax", 1024, 16.0),
        _rec("softmax", 2048, None, "too slow: one call took 9 s"),
        _rec("fast", 256, 0.5), _rec("fast", 512, 2.0), _rec("fast", 1024, 3.0),
        _rec("fast", 2048, 5.0),
        _rec("late", 256, 2.0), _rec("late", 512, 3.0), _rec("late", 1024, 20.0),
        _rec("late", 2048, 30.0),  # softmax did not finish at 2048: a win, but 1024 was a loss
        _rec("dip", 256, 0.5), _rec("dip", 512, 5.0), _rec("dip", 1024, 8.0),
        _rec("never", 256, 2.0), _rec("never", 512, 5.0),
        _rec("never", 1024, None, "oom: can't allocate memory"),
    ]
    assert results.crossover(records) == {"dip": 1024, "fast": 256, "late": 2048, "never": None}
    assert results.crossover(records, "fwdbwd") == {}


def test_table_marks_statuses():
    records = [_rec("softmax", 256, 1.5), _rec("x", 256, None, "refused: cannot"),
               _rec("x", 512, 0.25), _rec("softmax", 512, None, "skipped: too slow at N=256")]
    lines = results.table(records, "fwd").splitlines()
    assert lines[0].split() == ["method", "256", "512"]
    assert lines[2].split() == ["softmax", "1.5", "skipped"]
    assert lines[3].split() == ["x", "refused", "0.25"]


def test_store_rewrites_atomically_and_rejects_a_corrupt_file(tmp_path):
    store = results.ResultStore(tmp_path)
    fields = Config(method="softmax", length=8, pass_name="fwd").fields()
    store.add({**fields, "status": "ok", "median_ms": 1.0})
    store.add({**fields, "status": "ok", "median_ms": 2.0})  # same key: replaced
    assert [r["median_ms"] for r in results.ResultStore(tmp_path).records()] == [2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "results.json"]
    # Shared like any file open() creates, not owner-only as the temporary file was.
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o666 & ~umask
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot resume"):
        results.ResultStore(tmp_path)


def test_matmul_peak_is_plausible():
    peak = flops.matmul_peak(torch.float32, max_size=256, repeats=2)
    assert math.isfinite(peak) and peak > 0.05


def test_causal_flop_model_counts_the_chunkwise_gemms():
    # N = 100 in chunks of 32: 4 chunks, the last padded to 128 tokens; F = 64 projections.
    kw = dict(batch=1, heads=2, n=100, m=100, head_dim=16, value_dim=16)
    opts = {"num_features": 64, "chunk_size": 32}
    causal = flops.forward_flops("performer", opts, causal=True, **kw)
    features = 200 * 64 * 16
    intra = 128 * 32 * (64 + 17)
    state = 2 * 128 * 64 * 17  # the scan over chunks is elementwise: no GEMM FLOPs
    assert causal == 2 * 2 * (features + intra + state)
    assert causal > flops.forward_flops("performer", opts, causal=False, **kw)


def test_the_warm_up_runs_past_a_window():
    """The warm-up call takes the measured call's paths: a window hybrid shorter than its
    window is exact softmax, so its warm-up runs past the window (2 W + 2 tokens, capped by the
    length); other methods warm up at WARM_LENGTH."""
    hybrid = effattn.build("performer", head_dim=8, heads=2, window=64)
    plain = effattn.build("performer", head_dim=8, heads=2)
    assert speed.warm_length(Config("performer", 4096, "fwdbwd"), hybrid) == 130
    assert speed.warm_length(Config("performer", 100, "fwdbwd"), hybrid) == 100
    assert speed.warm_length(Config("performer", 4096, "fwdbwd"), plain) == speed.WARM_LENGTH
    assert speed.warm_length(Config("performer", 16, "fwdbwd"), plain) == 16
