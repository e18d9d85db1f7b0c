import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import effattn
from effattn.cli import main
from effattn.cli.common import parse_entry, parse_options, parse_value
from effattn.tools import compare as cmp
from effattn.tools.bench import speed
from effattn.tools.checkpoints import load_checkpoint
from effattn.tools.tasks.data import task_options


def test_methods_table_lists_every_method(capsys):
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


# Tiny settings of every command that does work, so that a test which gets past the checks it
# means to exercise still finishes in a second or two.
TINY = {
    "bench": ["--methods", "softmax", "--lengths", "16", "--heads", "1", "--head-dim", "8",
              "--repeats", "1", "--warmup", "0", "--passes", "fwd"],
    "approx": ["--methods", "performer", "--budget", "performer=4", "--length", "16", "--heads",
               "1", "--head-dim", "8", "--seeds", "1", "--qk-std", "1", "--kernel-features", "4",
               "--kernel-draws", "2"],
    "decode": ["--methods", "softmax", "--lengths", "2", "--batch", "1", "--d-model", "8",
               "--heads", "2", "--layers", "1", "--vocab", "8", "--prompt-len", "2"],
    "train": ["--task", "copy", "--steps", "1", "--d-model", "16", "--heads", "2", "--layers",
              "1", "--batch-size", "2", "--seq-len", "8", "--device", "cpu",
              "--task-option", "test_size=2", "--task-option", "valid_size=2"],
}
TINY["compare"] = ["--methods", "softmax", *TINY["train"]]


def _run(argv, capsys):
    """main(argv) -> (exit status, stderr), whether main returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


# Each tool dependency in turn made unimportable (after torch, which may import it itself), then
# every command run once in the same process: the tools' commands end with one line, exit 2.
_WITHOUT_TOOLS = """
import contextlib, io, json, sys
import torch
from effattn.cli import TOOL_COMMANDS, main
from effattn.tools import REQUIRES
outcome = {}
for module in REQUIRES:
    kept = sys.modules.pop(module, None)
    sys.modules[module] = None
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        outcome[module + ' ' + argv[0]] = [code, out.getvalue(), err.getvalue()]
    del sys.modules[module]
    if kept is not None:
        sys.modules[module] = kept
loaded = [m for m in sys.modules if m.startswith(('effattn.tools.', *TOOL_COMMANDS))]
print(json.dumps({'outcome': outcome, 'loaded': loaded}))
"""


def test_tool_commands_without_the_tools_say_what_to_install():
    argvs = [["methods", "softmax"], *([c, *TINY[c], "--help"] for c in TINY)]
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TOOLS, json.dumps(argvs)],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(effattn.__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["loaded"] == []
    for case, (code, out, err) in report["outcome"].items():
        missing, command = case.split()
        if command == "methods":
            assert (code, err) == (0, "") and "softmax" in out, case
        else:
            assert code == 2 and out == "", case
            assert err == (f"effattn {command} needs the tools: pip install 'effattn[tools]' "
                           f"(missing: {missing})\n"), case


def test_tool_commands_are_the_ones_their_modules_add():
    import argparse
    import importlib

    from effattn.cli import LIBRARY_COMMANDS, TOOL_COMMANDS, build_parser

    for module, commands in TOOL_COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).add_parser(sub)
        assert tuple(sub.choices) == commands, module
    listed = build_parser()._subparsers._group_actions[0].choices
    assert list(listed) == [m.rsplit(".", 1)[1] for m in LIBRARY_COMMANDS] + [
        c for commands in TOOL_COMMANDS.values() for c in commands]


def test_unknown_arguments_are_still_an_error(capsys):
    code, err = _run(["methods", "--bogus"], capsys)
    assert code == 2 and "unrecognized arguments: --bogus" in err


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail the test if bench or decode starts a measuring worker."""
    def refuse(*args):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("effattn.tools.bench.speed.run_isolated", refuse)
    monkeypatch.setattr("effattn.tools.decode.run_isolated", refuse)


@pytest.mark.parametrize("key, default, text, value", [
    ("orthogonal", True, "false", False), ("orthogonal", True, "FALSE", False),
    ("gated", False, "No", False), ("gated", False, "0", False),
    ("learn_sigma", False, "True", True), ("shared_qk", False, "yes", True),
    ("shared_qk", False, "1", True), ("num_features", 256, "64", 64),
    ("redraw_interval", 1000, "none", None), ("redraw_interval", 1000, "None", None),
    ("sigma", 1.0, "2", 2.0), ("sigma", 1.0, "0.5", 0.5),
    ("share", "none", "none", "none"), ("feature_map", "positive", "'trig'", "trig"),
    ("global_tokens", (0,), "(0, 5)", (0, 5)), ("global_tokens", (0,), "[1]", (1,)),
    ("global_tokens", (0,), "3", (3,)), ("stride", None, "none", None),
    ("stride", None, "16", 16), ("scale", None, "0.5", 0.5),
])
def test_option_values_are_typed_by_the_default(key, default, text, value):
    parsed = parse_value(key, text, default)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("key, default, text, message", [
    ("orthogonal", True, "maybe", "option orthogonal takes a bool"),
    ("gated", False, "2", "option gated takes a bool"),
    ("num_features", 256, "abc", "option num_features takes an integer"),
    ("num_features", 256, "6.5", "option num_features takes an integer"),
    ("sigma", 1.0, "wide", "option sigma takes a number"),
    ("global_tokens", (0,), "first", "option global_tokens takes a tuple"),
])
def test_option_values_of_the_wrong_type_name_the_option(key, default, text, message):
    with pytest.raises(ValueError, match=message):
        parse_value(key, text, default)


def test_method_entries_and_task_options_are_typed():
    assert parse_entry("rfa:gated=no,num_features=8,sigma=2") == (
        "rfa", {"gated": False, "num_features": 8, "sigma": 2.0})
    with pytest.raises(ValueError, match="rfa has no option 'bogus'; its options: num_features"):
        parse_entry("rfa:bogus=1")
    assert parse_options(["test_size=8", "vocab=none"], task_options("copy")) == {
        "test_size": 8, "vocab": None}
    run, _ = cmp.resolve("copy", [parse_entry("rfa:learn_sigma=false,gated=0")])
    assert run == [("rfa", {"learn_sigma": False, "gated": False})]


@pytest.mark.parametrize("method, key", [
    ("performer", "orthogonal"), ("favor", "orthogonal"), ("rfa", "gated"),
    ("rfa", "learn_sigma"), ("reformer", "shared_qk"),
])
@pytest.mark.parametrize("text, value", [("false", False), ("yes", True)])
def test_bench_bool_options_reach_the_method_as_bools(method, key, text, value, tmp_path,
                                                      capsys, monkeypatch):
    if method not in effattn.methods():
        pytest.skip(f"{method} is not registered")
    seen = []

    def fake_worker(target, args, timeout):
        if target is speed.probe_machine:
            return {"status": "timeout: not probed in this test"}
        seen.append(dict(args[0].options))
        return {"status": "refused: not measured in this test"}

    monkeypatch.setattr("effattn.tools.bench.speed.run_isolated", fake_worker)
    argv = ["bench", *TINY["bench"], "--methods", method, "--option", f"{key}={text}",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    assert seen == [{key: value}]
    record = json.loads((tmp_path / "results.json").read_text())[0]
    assert record["options"] == f"{key}={value}"


@pytest.mark.parametrize("option, message", [
    ("num_features=abc", "option num_features takes an integer, got 'abc'"),
    ("num_features=-3", "performer: num_features must be a positive int, got -3"),
    ("orthogonal=maybe", "option orthogonal takes a bool"),
    ("feature_map=cosine", "performer: feature_map must be one of"),
])
def test_bench_bad_option_values_exit_2_before_measuring(option, message, tmp_path, capsys,
                                                         no_measuring):
    code, err = _run(["bench", *TINY["bench"], "--methods", "softmax,performer",
                      "--option", option, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["decode", *TINY["decode"], "--methods", "rfa:num_features=0"],
     "rfa: num_features must be a positive int, got 0"),
    (["decode", *TINY["decode"], "--methods", "rfa", "--option", "gated=maybe"],
     "option gated takes a bool"),
    (["approx", *TINY["approx"], "--budget", "performer=-3"],
     "performer: num_features must be a positive int, got -3"),
    (["approx", *TINY["approx"], "--budget", "performer=16,abc"],
     "option num_features takes an integer, got 'abc'"),
    (["train", *TINY["train"], "--method", "rfa", "--option", "gated=maybe"],
     "option gated takes a bool"),
    (["train", *TINY["train"], "--method", "performer", "--option", "num_features=0"],
     "performer: num_features must be a positive int, got 0"),
    (["compare", *TINY["train"], "--methods", "performer:num_features=0"],
     "performer: num_features must be a positive int, got 0"),
    (["train", *TINY["train"], "--task-option", "nosuch=1"],
     "task 'copy': no option 'nosuch'; valid options: valid_size, test_size, vocab"),
    (["train", *TINY["train"], "--task-option", "test_size=many"],
     "option test_size takes an integer"),
    (["bench", *TINY["bench"], "--lengths", "12x"], "bad length '12x'"),
    (["train", *TINY["train"], "--device", "tpu"], "bad device 'tpu'"),
    (["train", *TINY["train"], "--steps", "0"], "steps must be a positive int"),
    (["methods", "nope"], "valid names"),
])
def test_user_mistakes_are_one_line_and_exit_2(argv, message, tmp_path, capsys, no_measuring):
    code, err = _run([*argv, "--out", str(tmp_path / "out")] if argv[0] != "methods" else argv,
                     capsys)
    assert code == 2
    assert message in err and "Traceback" not in err and "_synthetic" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["bench", "approx", "decode", "train", "compare"])
@pytest.mark.parametrize("where", ["a file", "/proc"])
def test_unwritable_out_exits_2_before_any_work(command, where, tmp_path, capsys, monkeypatch,
                                                 no_measuring):
    def no_study(*args, **kwargs):
        raise AssertionError("the study ran")

    monkeypatch.setattr("effattn.tools.approx.output_error_study", no_study)
    monkeypatch.setattr(f"effattn.cli.train.{'train' if command == 'train' else 'compare'}",
                        no_study)
    if where == "a file":
        out = tmp_path / "taken"
        out.write_text("not a folder")
    else:
        out = Path("/proc/effattn-test/out")
    code, err = _run([command, *TINY[command], "--out", str(out)], capsys)
    assert code == 2
    assert err.strip() == err.strip().splitlines()[0] and f"--out {out}" in err, err


def test_ctrl_c_in_bench_keeps_what_finished_and_the_same_command_resumes(tmp_path, capsys,
                                                                          monkeypatch):
    real, calls = speed.run_isolated, []

    def interrupted_second(target, args, timeout):
        if target is speed.probe_machine:
            return real(target, args, timeout)
        calls.append(args[0].length)
        if args[0].length == 16:  # the second configuration (the first may be retried)
            raise KeyboardInterrupt
        return real(target, args, timeout)

    monkeypatch.setattr(speed, "run_isolated", interrupted_second)
    argv = ["bench", *TINY["bench"], "--lengths", "8,16", "--out", str(tmp_path)]
    code, err = _run(argv, capsys)
    assert code == 130 and "Traceback" not in err
    assert f"saved in {tmp_path}; run the same command again to resume" in err
    kept = json.loads((tmp_path / "results.json").read_text())
    assert [r["length"] for r in kept] == [8]

    monkeypatch.setattr(speed, "run_isolated", real)
    assert main(argv) == 0
    # A record marked disturbed (a loaded machine) is measured again on resume; others are kept.
    resumed = 0 if kept[0].get("disturbed") else 1
    assert f"{2 - resumed} configurations measured, {resumed} already" in capsys.readouterr().out
    assert [r["length"] for r in json.loads((tmp_path / "results.json").read_text())] == [8, 16]


def test_ctrl_c_in_decode_exits_130_with_a_resume_hint(tmp_path, capsys, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr("effattn.tools.decode.run_isolated", interrupt)
    code, err = _run(["decode", *TINY["decode"], "--out", str(tmp_path)], capsys)
    assert code == 130 and "Traceback" not in err
    assert "run the same command again to resume" in err


def test_sigint_to_a_training_run_exits_130_and_keeps_its_checkpoint(tmp_path):
    from effattn.tools.train import TrainConfig, train

    argv = [*TINY["train"], "--steps", "100000", "--checkpoint-every", "2", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": "src", "OMP_NUM_THREADS": "1"}
    # A shell that starts the test suite in the background (`cmd &`) hands its children SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler: restore the default, as a
    # terminal's Ctrl-C finds it.
    proc = subprocess.Popen([sys.executable, "-m", "effattn", "train", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (tmp_path / "checkpoint.pt").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 60 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "run the same command again to resume" in err
    # The checkpoint is whole, and the same configuration resumes from it.
    step = load_checkpoint(tmp_path / "checkpoint.pt")["step"]
    assert step >= 2
    cfg = TrainConfig(task="copy", steps=100000, d_model=16, heads=2, layers=1, batch_size=2,
                      seq_len=8, checkpoint_every=2, task_options={"test_size": 2, "valid_size": 2})
    assert train(cfg, tmp_path, resume=True, stop_after=step + 1, progress=False) is None
    assert f"resumed from step {step}" in (tmp_path / "train.log").read_text()
