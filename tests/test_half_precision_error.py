"""benchmarks/half_precision_error.py: its rows (every method with both strategies, and SDPA)
at a small size, the triton strategy within twice the gpu strategy's error, and bad arguments
exiting 2 with one line."""

import json

import pytest
from conftest import interpreted, load_script

pytest.importorskip("triton")

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
script = load_script(ROOT / "benchmarks" / "half_precision_error.py", "half_precision_error")


@interpreted
def test_rows_at_a_small_size(tmp_path):
    assert script.main(["--n", "80", "--heads", "2", "--head-dim", "16",
                        "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["method"], r["strategy"]) for r in rows] == [
        *((m, s) for m in script.METHODS for s in ("triton", "gpu")), ("sdpa", "sdpa")]
    assert (tmp_path / "results.csv").read_text().startswith(",".join(script.FIELDS))
    by = {(r["method"], r["strategy"]): r for r in rows}
    for method in script.METHODS:
        fused, copies = by[method, "triton"], by[method, "gpu"]
        names = ["out", "d_q", "d_k", "d_v"] + (["d_gate"] if "d_gate" in copies else [])
        for name in names:
            assert 0 < fused[name] < 2 * copies[name] < 2 ** -6, (method, name)


@pytest.mark.parametrize("argv, says", [(["--n", "0"], "--n must be >= 1"),
                                        (["--head-dim", "-1"], "--head-dim must be >= 1")])
def test_bad_arguments_exit_2_with_one_line(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
