"""benchmarks/gpu_peers.py: its CPU smoke mode writes the row schema and the plot, fla's rows
say why they are empty, and without a CUDA device it exits 2 with one line. The compiled suite
runs apart, for one method: inductor takes minutes on the CPU to compile them all."""

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_png, load_script

from effattn import strategy
from effattn.kernelized import gpu

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_peers.py"


def _script():
    return load_script(SCRIPT, "gpu_peers_benchmark")


peers = _script()


def test_smoke_on_the_cpu_writes_rows_and_plot(tmp_path):
    with strategy.force(kernelized="gpu"):
        assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--repeats", "1",
                           "--impls", "effattn,fla,sdpa,spans,chunks", "--out",
                           str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["strategies"]["kernelized"] == "gpu"
    rows = results["rows"]
    assert all(set(peers.ROW_KEYS) <= set(r) for r in rows)
    methods = {peers._label(name, opts) for name, opts in peers.METHODS}
    # The spans suite: the causal performer and linear with the backward in the forward's slices.
    spans = {f"performer-spans{gpu.SLICE_SCALE}", f"linear-spans{gpu.SLICE_SCALE}"}
    # The chunks suite: both methods at each larger chunk, in IEEE and TF32 products.
    spans |= {f"{name}-chunk{chunk}{suffix}" for name in ("performer", "linear")
              for chunk in peers.CHUNK_SIZES for suffix in ("", "-tf32")}
    for causal in (False, True):
        for pass_name in ("fwd", "fwdbwd"):
            got = {r["method"] for r in rows if r["impl"] == "effattn" and r["causal"] == causal
                   and r["pass"] == pass_name and r["ms"] is not None}
            want = methods | spans if causal else methods - {"rfa-gated"}
            assert got == want, (causal, pass_name)
    assert gpu.BACKWARD_SLICE_SCALE < gpu.SLICE_SCALE  # restored after the spans suite
    assert torch.backends.cuda.matmul.fp32_precision != "tf32"  # and after the chunks suite
    assert {r["impl"] for r in rows} == {"effattn", "fla", "sdpa"}
    assert all(r["device"] == "cpu" and r["peak_mib"] is None for r in rows)
    fla = [r for r in rows if r["impl"] == "fla"]
    try:
        import fla as _  # noqa: F401
    except ImportError:
        assert fla and all(r["error"] == "fla: not installed" for r in fla)
    assert_png(tmp_path / "results.png")


def test_without_cuda_it_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peers.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow  # about 50 s on 2 cores with inductor's cache empty: four compilations
def test_compiled_rows_time_apart_their_first_call_and_match_eager(tmp_path):
    with strategy.force(kernelized="gpu"):
        assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--repeats", "1",
                           "--impls", "compiled", "--methods", "performer",
                           "--out", str(tmp_path)]) == 0
        rows = json.loads((tmp_path / "results.json").read_text())["rows"]
        assert sorted((r["causal"], r["pass"]) for r in rows) == [
            (False, "fwd"), (False, "fwdbwd"), (True, "fwd"), (True, "fwdbwd")]
        for r in rows:
            assert (r["impl"], r["method"]) == ("effattn", "performer-compiled")
            assert "error" not in r and r["ms"] is not None and r["compile_s"] > 0
        for causal in (False, True):
            p = peers.Point(40, 1, 2, "fp32", causal, torch.device("cpu"))
            methods = [("performer", {})]
            (compiled,) = peers.compiled_suite(p, methods)
            (eager,) = peers.effattn_suite(p, methods)
            with torch.no_grad():
                torch.testing.assert_close(compiled.run(), eager.run(), rtol=1e-5, atol=1e-5)


def test_a_failed_compile_is_a_row_with_its_error(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: refuse)
    assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--repeats", "1",
                       "--impls", "compiled", "--methods", "linear",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 4
    assert all(r["ms"] is None and r["compile_s"] is None
               and r["error"] == "RuntimeError: no compiler here" for r in rows)


@pytest.mark.parametrize("methods", ["nope", "performer,rfa-gate"])
def test_an_unknown_method_exits_2_with_one_line(methods, tmp_path, capsys):
    assert peers.main(["--device", "cpu", "--smoke", "--methods", methods,
                       "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--methods" in err
    assert not (tmp_path / "results.json").exists()


def test_triton_rows_force_the_fused_strategy_for_the_causal_methods(tmp_path):
    """The triton suite on the CPU (Triton's interpreter): a row for each fused causal method,
    equal to the GPU strategy's output; none non-causal."""
    pytest.importorskip("triton")
    assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--repeats", "1",
                       "--impls", "triton", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    labels = {peers._label(name, opts) for name, opts in peers.METHODS if name in peers.FUSED}
    assert {r["method"] for r in rows} == {f"{label}-triton" for label in labels}
    assert all(r["causal"] and "error" not in r and r["ms"] is not None for r in rows)
    p = peers.Point(40, 1, 2, "fp32", True, torch.device("cpu"))
    (fused_case,) = peers.triton_suite(p, [("performer", {})])
    (eager,) = peers.effattn_suite(p, [("performer", {})])
    with torch.no_grad(), strategy.force(kernelized="gpu"):
        torch.testing.assert_close(fused_case.run(), eager.run(), rtol=1e-5, atol=1e-5)


def test_tf32_rows_hold_the_setting_while_measured_and_restore_it(tmp_path, monkeypatch):
    """The tf32 suite: the effattn and triton rows again, each measured (backward included)
    with fp32 CUDA matmuls on TF32, the setting restored after the suite."""
    pytest.importorskip("triton")
    seen = []
    timer = peers.timer

    def spy(fn, device, repeats):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return timer(fn, device, repeats)

    monkeypatch.setattr(peers, "timer", spy)
    before = torch.backends.cuda.matmul.fp32_precision
    assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--repeats", "1",
                       "--impls", "tf32", "--methods", "performer,linear",
                       "--out", str(tmp_path)]) == 0
    assert torch.backends.cuda.matmul.fp32_precision == before
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert sorted({r["method"] for r in rows}) == [
        "linear-tf32", "linear-triton-tf32", "performer-tf32", "performer-triton-tf32"]
    assert all("error" not in r and r["ms"] is not None for r in rows)
    assert seen and set(seen) == {"tf32"}


@pytest.mark.parametrize(("impl", "setting", "value", "suffix"), [
    ("segments", "SEGMENT_PROGRAMS", 0, "-unsplit"),
    ("floor", "SEGMENT_CHUNKS", peers.FLOOR_CHUNKS, f"-floor{peers.FLOOR_CHUNKS}"),
])
def test_segment_rows_hold_their_setting_while_measured_and_restore_it(impl, setting, value,
                                                                       suffix, tmp_path,
                                                                       monkeypatch):
    """The segments suite (every launch in one segment) and the floor suite (segments of at
    least FLOOR_CHUNKS chunks): the triton rows again, each measured (backward included) with
    the fused kernels' setting held, the default restored after the suite."""
    pytest.importorskip("triton")
    from effattn.kernelized import fused_kernels

    seen = []
    timer = peers.timer

    def spy(fn, device, repeats):
        seen.append(getattr(fused_kernels, setting))
        return timer(fn, device, repeats)

    monkeypatch.setattr(peers, "timer", spy)
    before = getattr(fused_kernels, setting)
    assert before != value
    assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--repeats", "1",
                       "--impls", impl, "--methods", "performer,hedgehog",
                       "--out", str(tmp_path)]) == 0
    assert getattr(fused_kernels, setting) == before
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {f"performer-triton{suffix}",
                                           f"hedgehog-triton{suffix}"}
    assert all("error" not in r and r["ms"] is not None for r in rows)
    assert seen and set(seen) == {value}


@pytest.mark.parametrize("argv, says", [
    (["--impls", "effattn,nope"], "--impls"),
    (["--lengths", "4096,5"], "--lengths"),
    (["--lengths", "x"], "--lengths"),
])
def test_bad_impls_or_lengths_exit_2_with_one_line(argv, says, tmp_path, capsys):
    assert peers.main(["--device", "cpu", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert not (tmp_path / "results.json").exists()


def test_lengths_narrow_the_sweep():
    chosen = list(peers.points(torch.device("cpu"), False, ["bf16"], {4096}))
    assert {(p.n, p.batch) for p in chosen} == {(4096, 1), (4096, 8)}
    assert len(chosen) == 4  # causal and not


def test_an_unwritable_out_exits_2_with_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert peers.main(["--device", "cpu", "--smoke", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err


def test_ctrl_c_keeps_the_finished_rows_and_exits_130(tmp_path, capsys, monkeypatch):
    measured = []

    def interrupted(fn, device, repeats):
        if measured:
            raise KeyboardInterrupt
        measured.append(1)
        return 1.0

    monkeypatch.setattr(peers, "timer", interrupted)
    with strategy.force(kernelized="gpu"):
        assert peers.main(["--device", "cpu", "--smoke", "--dtypes", "fp32", "--impls", "sdpa",
                           "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["ms"] == 1.0
