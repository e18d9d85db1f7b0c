"""benchmarks/host_overhead.py: the host time of an eager banded call, split at the value
check's read, with the compiled FlexAttention kernel stubbed (so it runs on the CPU). Rows and
restored state are checked, not the times (they move with the machine's load)."""

import json
from pathlib import Path

import pytest
from conftest import load_script

from effattn import base
from effattn.mechanisms.local import LocalAttention
from effattn.sparse import flex

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"
overhead = load_script(SCRIPT, "host_overhead_benchmark")


def test_rows_for_both_modes_and_everything_restored(tmp_path, capsys):
    saved = (flex.compiled_on, flex._kernel, base._read_values)
    assert overhead.main(["--methods", "local", "softmax+window128", "--calls", "3",
                          "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["method"], r["mode"]) for r in rows] == [
        ("local", "check"), ("local", "engine"),
        ("softmax+window128", "check"), ("softmax+window128", "engine")]
    for r in rows:
        assert 0 < r["after_us"] < r["total_us"] and 0 < r["before_us"] < r["total_us"]
        assert r["cpu"] and r["calls"] == 3
    assert (flex.compiled_on, flex._kernel, base._read_values) == saved
    assert LocalAttention.engine_reads_values
    assert "host µs per eager call" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--length", "100"], ["--calls", "0"], ["--methods", "x"]])
def test_bad_arguments_exit_2_naming_them(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        overhead.main([*argv, "--out", str(tmp_path)])
    assert raised.value.code == 2
    assert argv[0] in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_an_unusable_out_exits_2_before_measuring(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as raised:
        overhead.main(["--out", str(blocker / "results")])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err
