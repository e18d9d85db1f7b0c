"""The triton strategy's kernels compiled ahead of time for GPUs (no driver needed), by
benchmarks/triton_resources.py: they compile for sm_80 and sm_90 in every dtype and fit the
architecture's shared memory; in bf16 on sm_90 they spill a few bytes a thread at most (16 in
the keys' backward with φ read, more with a map formed inside), and with fp32 on TF32 at most
72 bytes (424 with Taylor's product map, 112 in the per-feature core's keys' backward). The
per-feature core's kernels (Hedgehog's exp map) compile for every dtype but half precision,
which they read as it is and compute in fp32.

The script runs in a process of its own without TRITON_INTERPRET (which tests/conftest.py sets
here for the kernels' CPU tests): under the interpreter's settings Triton's compiler fails."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

pytest.importorskip("triton")

from effattn.kernelized import fused_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "triton_resources.py"
resources = load_script(SCRIPT, "triton_resources_benchmark")


def _run(tmp_path, *argv):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "results.csv").read_text().startswith(",".join(resources.FIELDS))
    return json.loads((tmp_path / "results.json").read_text())["rows"]


def test_bf16_kernels_compile_for_sm90_nearly_without_spills(tmp_path):
    rows = _run(tmp_path, "--archs", "90", "--dtypes", "bf16")
    assert [(r["dtype"], r["kernel"], r["gated"], r["map"]) for r in rows] == [
        ("bf16", k.__name__.strip("_"), gated, map_)
        for k, gated, map_ in resources.variants(fused_kernels.KERNELS)]
    assert not any(resources.applies("exponents", name) for name in resources.HALF)
    for r in rows:
        # Measured (the keys' backward spills most): with φ read 16 bytes; with the positive
        # map formed inside up to 64; with the relu map up to 104; with the sine map up to 64,
        # most sine kernels 32 (sin's and cos's own stack: the local array of their range
        # reduction of large arguments); with the elu map, which forms φ in fp32 from bf16 x,
        # up to 256; with Taylor's product map (two factors of x̃, P = 16) up to 480, in the
        # queries' backward.
        limit = {"read": 16, "exp": 64, "sine": 128, "relu": 128, "product": 512,
                 "elu": 320}[r["map"]]
        assert r["fits"] and r["spill_bytes"] <= limit, r
        launch = ((fused_kernels.RATIO_WARPS, fused_kernels.RATIO_TOKENS)
                  if r["kernel"] == "divisor_grad_kernel" else (8, 32))
        assert (r["num_warps"], r["chunk"], r["feature_block"]) == (*launch, 64), r


def test_tf32_products_compile_for_sm90_nearly_without_spills(tmp_path):
    """fp32 with torch's fp32 matmuls set to TF32 (which the kernels' products follow): tensor
    cores, a chunk of 16 (the divisor's gradient, an elementwise pass, takes 64 tokens a
    program), and at most a few bytes spilled a thread (72 when measured, against about 3.5 KiB
    with IEEE products, which lower to FMA loops; 424 in the queries' backward with Taylor's
    product map, 112 in the per-feature core's keys' backward)."""
    rows = _run(tmp_path, "--archs", "90", "--dtypes", "tf32")
    assert len(rows) == len(resources.variants(resources.all_kernels()))
    assert sum(r["map"] == "exponents" for r in rows) == 4
    for r in rows:
        chunk = fused_kernels.RATIO_TOKENS if r["kernel"] == "divisor_grad_kernel" else 16
        assert r["dtype"] == "tf32" and r["chunk"] == chunk and r["fits"], r
        assert r["spill_bytes"] <= (512 if r["map"] == "product" else 256), r


@pytest.mark.slow  # fp32 products in IEEE compile slowly: a minute or two in all
def test_every_dtype_fits_both_architectures(tmp_path):
    dtypes = ("fp16", "fp32", "bf16-values", "fp64")
    rows = _run(tmp_path, "--archs", "80,90", "--dtypes", ",".join(dtypes))
    assert len(rows) == 2 * sum(resources.applies(map_, name) for name in dtypes
                                for _, _, map_ in resources.variants(resources.all_kernels()))
    assert all(r["fits"] for r in rows), [r for r in rows if not r["fits"]]


@pytest.mark.parametrize("argv, says", [
    (["--archs", "70"], "unknown architectures"),
    (["--dtypes", "int8"], "unknown dtypes"),
    ([], "unset TRITON_INTERPRET"),  # tests/conftest.py sets it here
])
def test_bad_arguments_exit_2_with_one_line(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        resources.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
