"""benchmarks/paired_trees.py: two trees (here the same one twice) timed in a worker process each,
their outputs compared; the results written as JSON; a folder without effattn refused."""

import json
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paired_trees.py"


def _script():
    return load_script(SCRIPT, "paired_trees_benchmark")


def test_the_same_tree_twice_gives_equal_outputs_and_a_ratio(tmp_path, capsys):
    out = tmp_path / "paired.json"
    src = str(ROOT / "src")
    assert _script().main(["--old", src, "--new", src, "--methods", "linear,linear:causal",
                           "--lengths", "40", "--repeats", "2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert sorted(results) == [f"linear{flag} N=40 {p}" for flag in ("", ":causal")
                               for p in ("fwd", "fwdbwd")]
    for row in results.values():
        assert row["max_abs_diff"] == 0.0  # one tree, one seed: the same numbers
        assert row["old_ms"] > 0 and row["new_ms"] > 0 and row["new_over_old"] > 0
    assert "new/old" in capsys.readouterr().out


def test_a_folder_without_effattn_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        _script().main(["--old", str(tmp_path), "--new", str(ROOT / "src")])
    assert err.value.code == 2
    assert "--old" in capsys.readouterr().err


def test_an_unknown_method_and_an_unwritable_out_are_refused(tmp_path, capsys):
    src = str(ROOT / "src")
    with pytest.raises(SystemExit) as err:
        _script().main(["--old", src, "--new", src, "--methods", "nosuch", "--lengths", "40"])
    assert err.value.code == 2
    assert "--methods: unknown attention method 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        _script().main(["--old", src, "--new", src, "--out", str(tmp_path / "no" / "x.json")])
    assert err.value.code == 2
    assert "--out: cannot write" in capsys.readouterr().err
