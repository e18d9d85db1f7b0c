"""scripts/mutate.py, the planted-bug runner (docs/testing.md): its list is well formed, a pattern
found other than exactly once stops it with exit 2 and one line, and its table and JSON report
count what was caught. Runs no mutation (no test subprocess)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutate():
    """The script as a module (it is not part of the package)."""
    name = "effattn_scripts_mutate"
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def _entry(**kw):
    return {"id": "e", "file": "src/pkg/a.py", "pattern": "x = 1", "replacement": "x = 2",
            "tests": ["tests/test_a.py"], "description": "x is off by one", **kw}


def _repo(tmp_path, text="x = 1\ny = 2\n"):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text(text)
    return tmp_path


def test_the_projects_list_is_found_exactly_and_covers_the_engines(mutate):
    entries = mutate.load(mutate.DEFAULT_LIST)
    mutate.check(ROOT, entries)  # every pattern exactly once in today's code
    assert len(entries) >= 15
    files = {m.file for m in entries}
    for where in ("src/effattn/kernelized/hybrid.py", "src/effattn/convert.py",
                  "src/effattn/tools/convert.py", "src/effattn/kernelized/core.py",
                  "src/effattn/kernelized/cpu.py", "src/effattn/sparse/blockwise.py"):
        assert where in files, where
    assert any(f.startswith("src/effattn/integrations/") for f in files)
    for m in entries:
        assert all(t.startswith("tests/") for t in m.tests), m.id


@pytest.mark.parametrize(("text", "count"), [("y = 2\n", 0), ("x = 1\nx = 1\n", 2)])
def test_a_pattern_not_found_exactly_once_exits_2_with_one_line(mutate, tmp_path, capsys, text,
                                                                count):
    repo = _repo(tmp_path / "repo", text)
    listing = tmp_path / "list.json"
    listing.write_text(json.dumps([_entry()]))
    assert mutate.main(["--list", str(listing), "--root", str(repo)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"mutate.py: entry e: pattern found {count} times in src/pkg/a.py")


def test_a_bad_list_exits_2(mutate, tmp_path, capsys):
    repo = _repo(tmp_path / "repo")
    listing = tmp_path / "list.json"
    for bad, message in [([{"id": "e"}], "entry 0 lacks file, pattern"),
                         ([_entry(), _entry()], "entry id e appears twice"),
                         ([_entry(tests=[])], "tests must be a non-empty list"),
                         ([_entry(file="src/pkg/b.py")], "no file src/pkg/b.py")]:
        listing.write_text(json.dumps(bad))
        assert mutate.main(["--list", str(listing), "--root", str(repo)]) == 2
        assert message in capsys.readouterr().err
    listing.write_text(json.dumps([_entry()]))
    assert mutate.main(["--list", str(listing), "--root", str(repo), "--only", "zz"]) == 2
    assert "--only: no entry zz" in capsys.readouterr().err
    assert mutate.main(["--list", str(listing), "--root", str(repo), "--check"]) == 0


def test_the_table_and_json_count_each_status(mutate):
    results = [mutate.Result("a", "src/x.py", "one", "caught", 3.2, "FAILED t::a"),
               mutate.Result("b", "src/y.py", "two", "survived", 1.0, "1 passed"),
               mutate.Result("c", "src/z.py", "three", "error", 9.0, "timed out after 9 s")]
    text = mutate.table(results)
    assert "| a | src/x.py | caught | 3 | one |" in text
    assert "| b | src/y.py | survived | 1 | two |" in text
    assert text.endswith("3 entries: 1 caught, 1 survived, 1 errors")
    data = mutate.report(results)
    assert (data["caught"], data["survived"], data["errors"]) == (1, 1, 1)
    assert [e["id"] for e in data["entries"]] == ["a", "b", "c"]
    assert json.loads(json.dumps(data)) == data
