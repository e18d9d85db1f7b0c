"""effattn bench-distributed: records of spawned gloo ranks, bytes per layer, the CLI's errors."""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from effattn.cli import main
from effattn.tools import bench_distributed as bd

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

H, D, F = 2, 8, 16
TINY = ["--heads", str(H), "--head-dim", str(D), "--option", f"num_features={F}",
        "--repeats", "1", "--warmup", "0"]
HEADER = 16 * 8  # the call's header: 16 float64 values, gathered before any data
SRC = Path(__file__).resolve().parents[1] / "src"


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_performer_records_at_p2_and_bytes_independent_of_n(tmp_path, capsys):
    argv = ["bench-distributed", "--methods", "performer", "--lengths", "64,128", "--nproc",
            "2", *TINY, "--out", str(tmp_path)]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    records = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["length"], r["pass"]) for r in records) == [
        (64, "fwd"), (64, "fwdbwd"), (128, "fwd"), (128, "fwdbwd")]
    state = H * F * (D + 1) * 4  # φ(K)^T [V, 1] per (batch, head), fp32
    for r in records:
        assert r["status"] == "ok" and r["nproc"] == 2 and r["method"] == "performer", r
        assert len(r["peak_mib_ranks"]) == 2 and r["peak_mib"] == max(r["peak_mib_ranks"]) >= 0
        assert r["median_ms"] > 0 and r["samples"] == 1 and r["cpu"]
        # Forward: the header gather, the stabiliser max (H scalars) and the state sum; the
        # backward adds the state's gradient sum. Received: the header from both ranks.
        fwd = HEADER + H * 4 + state
        assert r["sent_bytes"] == (fwd if r["pass"] == "fwd" else fwd + state), r
        assert r["received_bytes"] == r["sent_bytes"] + HEADER
        assert r["collectives"] == (3 if r["pass"] == "fwd" else 4)
    assert "performer P=2 fwd: the same at every N (1,288)" in out
    for name in ("results.csv", "summary.json", "memory.png", "bytes.png", "time.png"):
        assert (tmp_path / name).stat().st_size > 0, name

    code, out, _ = _run(argv, capsys)  # the same command resumes: nothing to measure
    assert code == 0 and "0 configurations measured, 2 already" in out


def test_a_failing_rank_ends_the_configuration_and_skips_longer_ones(tmp_path, capsys):
    # A budget far below the ranks' inputs (96 MiB each): the allocation fails on the ranks,
    # which report it instead of waiting in a collective; the longer length is not tried.
    code, out, err = _run(["bench-distributed", "--methods", "linear", "--lengths",
                           "65536,131072", "--nproc", "2", "--passes", "fwd", "--max-memory",
                           "1", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    records = {r["length"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert records[65536]["status"].startswith("oom:"), records[65536]
    assert records[131072]["status"] == "skipped: oom at N=65536"
    assert "linear P=2 fwd: n/a (n/a MiB per rank); N=65536: oom" in out


# A spawned rank's life in a fresh interpreter: the threads named gloo while its group exists
# (after measure_rank, when they have served its collectives and named themselves) and once
# _rank_main has returned.
RANK_THREADS = """
import json, os, sys
from effattn.tools import bench_distributed as bd

def gloo_threads():
    tasks = os.listdir("/proc/self/task")
    return sorted(n for n in (open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
                  if "gloo" in n)

during, measure = [], bd.measure_rank
def measured(cfg, settings):
    result = measure(cfg, settings)
    during.extend(gloo_threads())
    return result

bd.measure_rank = measured
cfg = bd.DistConfig(method="performer", length=32, nproc=1, heads=2, head_dim=8,
                    options=(("num_features", 8),))
bd._rank_main(0, cfg, bd.DistSettings(warmup=0, repeats=1), sys.argv[1])
print(json.dumps({"during": during, "after": gloo_threads()}))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads in /proc")
def test_a_rank_ends_its_group_before_interpreter_shutdown(tmp_path):
    # The first call of effattn's custom ops imports torch._dynamo, after the group started;
    # unless effattn.distributed imported torch.distributed.nn first, the group outlived
    # destroy_process_group and gloo's threads were torn down at interpreter shutdown, which
    # aborted the rank now and then on a busy machine (exit code -6).
    proc = subprocess.run([sys.executable, "-c", RANK_THREADS, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = json.loads(proc.stdout.splitlines()[-1])
    assert json.loads((tmp_path / "rank0.json").read_text())["status"] == "ok"
    assert threads["during"] and threads["after"] == [], threads


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("length", [32, 96])
def test_softmax_sends_its_keys_and_values(group_of_one, length):
    cfg = bd.DistConfig(method="softmax", length=length, nproc=1, heads=H, head_dim=D)
    result = bd.measure_rank(cfg, bd.DistSettings(repeats=1, warmup=0))
    kv = H * length * 2 * D * 4  # the all-gather of [K, V], which grows with N
    assert result["passes"]["fwd"]["sent_bytes"] == HEADER + kv
    # Backward: one all-reduce of the gathered gradient, P = 1 slices of [K, V].
    assert result["passes"]["fwdbwd"]["sent_bytes"] == HEADER + 2 * kv


def test_counter_restores_the_collectives():
    originals = dist.all_reduce, dist.all_gather
    with bd.CollectiveBytes():
        assert dist.all_reduce is not originals[0]
    assert (dist.all_reduce, dist.all_gather) == originals


def test_supported_methods_are_the_ones_sequence_parallel_wraps():
    supported = bd.supported_methods()
    assert {"performer", "linear", "rfa", "softmax", "local"} <= set(supported)
    assert not {"nystrom", "linformer", "reformer", "fnet"} & set(supported)


@pytest.fixture
def no_spawning(monkeypatch):
    def refuse(*args):
        raise AssertionError("processes were started")

    monkeypatch.setattr(bd, "run_spawned", refuse)


@pytest.mark.parametrize("extra, message", [
    (["--methods", "nystrom"], "nystrom cannot be split along the sequence"),
    (["--methods", "nosuch"], "unknown method(s) nosuch"),
    (["--lengths", "63"], "N = 63 does not split evenly over P = 2"),
    (["--option", "num_features=-3"], "performer: "),
    (["--nproc", "0"], "expected a positive integer"),
])
def test_mistakes_exit_2_with_one_line_before_any_work(extra, message, tmp_path, capsys,
                                                        no_spawning):
    argv = ["bench-distributed", "--methods", "performer", "--lengths", "64", "--nproc", "2",
            *extra, "--out", str(tmp_path / "out")]
    code, _, err = _run(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_exits_2(tmp_path, capsys, no_spawning):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    code, _, err = _run(["bench-distributed", "--methods", "performer", "--out", str(taken)],
                        capsys)
    assert code == 2 and f"--out {taken}: is a file" in err


def test_ctrl_c_keeps_what_finished_and_says_how_to_resume(tmp_path, capsys, monkeypatch):
    def first_then_interrupted(cfg, settings):
        if cfg.length > 64:
            raise KeyboardInterrupt
        row = {"status": "ok", "peak_mib": 1.0, "sent_bytes": 8, "received_bytes": 16,
               "collectives": 1, "median_ms": 2.0, "iqr_ms": 0.0, "samples": 1}
        return "ok", [{"status": "ok", "runtime_mib": 100.0, "inputs_mib": 0.5,
                       "passes": {"fwd": row}}] * cfg.nproc

    monkeypatch.setattr(bd, "run_spawned", first_then_interrupted)
    code, _, err = _run(["bench-distributed", "--methods", "performer", "--lengths", "64,128",
                         "--nproc", "2", "--passes", "fwd", "--out", str(tmp_path)], capsys)
    assert code == 130 and "Traceback" not in err
    assert f"saved in {tmp_path}; run the same command again to resume" in err
    kept = json.loads((tmp_path / "results.json").read_text())
    assert [(r["length"], r["status"], r["peak_mib_ranks"]) for r in kept] == [
        (64, "ok", [1.0, 1.0])]


def test_memory_scaling_and_longest_from_records():
    def rec(n, p, peak, status="ok"):
        return {"method": "m", "pass": "fwd", "length": n, "nproc": p, "peak_mib": peak,
                "status": status, "max_memory_mib": 100.0}

    records = [rec(1024, 1, 40.0), rec(1024, 4, 11.0), rec(4096, 4, 44.0),
               rec(8192, 4, None, "oom: x")]
    (row,) = bd.memory_scaling(records)
    assert row["ratio"] == pytest.approx(1.1) and row["goal_met"]
    reach = {r["nproc"]: r for r in bd.longest(records)}
    assert reach[1]["longest"] == 1024 and reach[1]["failed_at"] is None
    assert (reach[4]["longest"], reach[4]["failed_at"]) == (4096, 8192)
