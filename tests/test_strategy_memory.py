"""benchmarks/strategy_memory.py: a small run writes its rows (each strategy, the span sweep and
SDPA), CSV and plot, restores the span constant it sweeps; the triton strategy's dry kernels
account as the interpreted ones and allow bf16 rows; bad arguments exit 2 with one line."""

import json
from pathlib import Path

import pytest
from conftest import assert_png, interpreted, load_script

from effattn.kernelized import gpu
from effattn.kernelized.base import KernelizedAttention

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "strategy_memory.py"


def _script():
    return load_script(SCRIPT, "strategy_memory_benchmark")


bench = _script()


def test_small_run_writes_rows_csv_and_plot(tmp_path):
    default = gpu.BACKWARD_SLICE_SCALE
    assert bench.main(["--methods", "linear", "--lengths", "96", "--backward-scales", "64,16",
                       "--out", str(tmp_path)]) == 0
    assert default == gpu.BACKWARD_SLICE_SCALE
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["method"], r["strategy"], r["backward_scale"]) for r in rows] == [
        ("linear", "cpu", None), ("linear", "gpu", 64), ("linear", "gpu", 16),
        ("sdpa", "sdpa", None)]
    for r in rows:
        assert set(bench.FIELDS) <= set(r)
        assert 0 < r["fwd_peak_mib"] <= r["train_peak_mib"]
        assert r["fwd_ops"] > 0 and r["bwd_ops"] > 0
    assert (tmp_path / "results.csv").read_text().startswith(",".join(bench.FIELDS))
    assert_png(tmp_path / "peaks.png")


@interpreted
def test_triton_rows_count_their_launches(tmp_path):
    """The fused kernels under Triton's interpreter: fewer operations than the GPU strategy,
    and their launches apart (one slice and one backward span: 1 forward, 3 backward: the
    divisor's gradient, then the queries' and the keys')."""
    pytest.importorskip("triton")
    assert bench.main(["--methods", "linear", "--lengths", "96", "--strategies", "gpu,triton",
                       "--out", str(tmp_path)]) == 0
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert set(rows) == {"gpu", "triton", "sdpa"}
    assert rows["triton"]["launches"] == 4 and rows["gpu"]["launches"] == 0
    assert rows["triton"]["fwd_ops"] < rows["gpu"]["fwd_ops"]
    assert 0 < rows["triton"]["fwd_peak_mib"] <= rows["triton"]["train_peak_mib"]


ACCOUNTED = ("method", "strategy", "n", "inputs_mib", "fwd_peak_mib", "train_peak_mib",
             "fwd_ops", "bwd_ops", "launches")


@pytest.fixture
def tiny(monkeypatch):
    """One head of 16 dims, and slices as short as they go: forward slices of one module chunk
    (32 tokens) and backward spans of one kernel chunk (16), so that N = 64 has two slices of
    two spans each (14 launches: 1 per slice, 3 per span; performer 26, with the row maxima of
    its map, which the kernels form: 2 per slice and per span; hedgehog 16, its shifts and its
    scan per slice), in seconds under the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setattr(bench, "HEADS", 1)
    monkeypatch.setattr(bench, "HEAD_DIM", 16)
    monkeypatch.setattr(KernelizedAttention, "slice_elements", 1)


def _triton_rows(out: Path, *argv: str) -> list[dict]:
    assert bench.main(["--methods", "linear,performer,rfa-gated,hedgehog", "--lengths", "64",
                       "--strategies", "triton", *argv, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())["rows"]


@interpreted
def test_dry_kernels_account_as_the_interpreted_ones(tiny, tmp_path):
    """Stand-ins that run nothing and write neutral values: the same peaks, operations and
    launches as the kernels run by the interpreter (the row core's and hedgehog's per-feature
    kernels: 2 per forward slice, the shifts and the scan, and 3 per span), and the kernels
    restored after the run."""
    from effattn.kernelized import fused_exponents_kernels, fused_kernels

    dry = _triton_rows(tmp_path / "dry")
    interpreted = _triton_rows(tmp_path / "interpreted", "--kernels", "interpret")
    for module in (fused_kernels, fused_exponents_kernels):
        assert all(getattr(module, k.__name__) is k for k in module.KERNELS)
    assert [[r[f] for f in ACCOUNTED] for r in dry] == [[r[f] for f in ACCOUNTED]
                                                       for r in interpreted]
    assert [(r["method"], r["launches"]) for r in dry] == [
        ("linear", 14), ("performer", 26), ("rfa-gated", 14), ("hedgehog", 16), ("sdpa", 0)]


def test_dry_kernels_give_bf16_rows(tiny, tmp_path):
    fp32 = _triton_rows(tmp_path / "fp32")
    bf16 = _triton_rows(tmp_path / "bf16", "--dtype", "bfloat16")
    # q, k, v (and the gate) at half the bytes; the triton rows dispatch the same kinds of work.
    assert [r["inputs_mib"] * 2 for r in bf16] == [r["inputs_mib"] for r in fp32]
    assert all(0 < r["fwd_peak_mib"] <= r["train_peak_mib"] for r in bf16)
    assert "bfloat16" in json.loads((tmp_path / "bf16" / "results.json").read_text())["shape"]


@pytest.mark.parametrize("argv, says", [
    (["--methods", "nosuch"], "unknown method"),
    (["--strategies", "tpu"], "unknown strategies"),
    (["--lengths", "0"], "positive ints"),
    (["--backward-scales", "x"], "comma-separated ints"),
    (["--kernels", "wet"], "invalid choice"),
    (["--dtype", "float16"], "invalid choice"),
    (["--strategies", "triton", "--kernels", "interpret", "--dtype", "bfloat16"], "bf16 tl.dot"),
])
def test_bad_arguments_exit_2_with_one_line(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_an_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--methods", "linear", "--out", str(blocker / "sub")])
    assert exit_.value.code == 2
    assert "--out" in capsys.readouterr().err
