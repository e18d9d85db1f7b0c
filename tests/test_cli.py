import subprocess
import sys

from effattn.cli import main


def test_methods_table_lists_every_method(capsys):
    import effattn

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in effattn.methods():
        assert f"`{name}`" in out


def test_methods_unknown_name_exits_2(capsys):
    assert main(["methods", "nope"]) == 2
    assert "valid names" in capsys.readouterr().err


def test_module_entry_point_runs():
    res = subprocess.run(
        [sys.executable, "-m", "effattn", "methods", "softmax"],
        capture_output=True, text=True, check=True,
        env={"PYTHONPATH": "src", "PATH": ""},
    )
    assert "softmax" in res.stdout
