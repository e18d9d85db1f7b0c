"""benchmarks/gpu_peers_banded.py runs: its CPU smoke mode writes the shared row schema and a
plot, and without CUDA it says so and exits 2 (the GPU numbers come from benchmarks/gpu.sh)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_png, load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_peers_banded.py"
SCHEMA = {"impl", "method", "n", "batch", "heads", "causal", "pass", "dtype", "ms", "peak_mib",
          "device", "compile_s"}


def _script():
    return load_script(SCRIPT, "gpu_peers_banded")


def test_smoke_run_writes_rows_of_the_schema_and_a_plot(tmp_path):
    out = tmp_path / "banded.json"
    methods = ["local", "bigbird", "softmax+softcap50", "linear+window128", "reformer"]
    assert _script().main(["--device", "cpu", "--smoke", "--methods", *methods,
                           "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(set(row) >= SCHEMA for row in rows)
    assert not [row for row in rows if row["ms"] is None], rows
    seen = {(row["impl"], row["method"]) for row in rows}
    assert {("effattn", "local"), ("flex", "local"), ("flex", "bigbird"),
            ("flex", "softmax+softcap50"), ("effattn", "linear+window128"),
            ("sdpa", "reformer")} <= seen
    assert ("flex", "linear+window128") not in seen
    assert_png(out.with_suffix(".png"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True,
                         env={"PYTHONPATH": str(SCRIPT.parents[1] / "src")})
    assert run.returncode == 2
    assert "no CUDA device" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
