"""benchmarks/gpu_peers.py: its CPU smoke mode writes the row schema and the plot, fla's rows
say why they are empty, and without a CUDA device it exits 2 with one line."""

import json
from pathlib import Path

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
                           "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["strategies"]["kernelized"] == "gpu"
    rows = results["rows"]
    assert all(set(peers.ROW_KEYS) <= set(r) for r in rows)
    methods = {peers._label(name, opts) for name, opts in peers.METHODS}
    # The spans suite: the causal performer and linear with the backward in the forward's slices.
    spans = {f"performer-spans{gpu.SLICE_SCALE}", f"linear-spans{gpu.SLICE_SCALE}"}
    for causal in (False, True):
        for pass_name in ("fwd", "fwdbwd"):
            got = {r["method"] for r in rows if r["impl"] == "effattn" and r["causal"] == causal
                   and r["pass"] == pass_name and r["ms"] is not None}
            want = methods | spans if causal else methods - {"rfa-gated"}
            assert got == want, (causal, pass_name)
    assert gpu.BACKWARD_SLICE_SCALE < gpu.SLICE_SCALE  # restored after the spans suite
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
