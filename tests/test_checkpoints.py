"""A run folder is data, never code: every loader of effattn (resume, ``--init-from``,
``load_run`` and ``convert --teacher``, the task data caches) reads checkpoints with torch's
restricted unpickler, so a crafted file runs nothing, and every bad file gets one clear error."""

import ast
import pickle
import re
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from effattn.cli import main
from effattn.tools.checkpoints import FORMAT, VERSION, CheckpointError, load_checkpoint
from effattn.tools.convert import ConvertPlan, convert
from effattn.tools.runs import load_run
from effattn.tools.tasks.data import make_task
from effattn.tools.train import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(__file__).resolve().parents[1] / "src" / "effattn"
TINY = {"d_model": 16, "layers": 1, "heads": 2, "batch_size": 4, "seq_len": 16,
        "task_options": {"test_size": 8, "valid_size": 4}}
LISTOPS = {"train_size": 16, "valid_size": 4, "test_size": 4}
CLI_TINY = ["--task", "copy", "--d-model", "16", "--heads", "2", "--layers", "1",
            "--batch-size", "4", "--seq-len", "16", "--task-option", "test_size=8",
            "--task-option", "valid_size=4"]


class _Planted:
    """Unpickling this runs code: it touches ``marker`` (what a crafted checkpoint would do with
    ``os.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).touch()",))


def _config(**kw):
    return TrainConfig(task="copy", method="softmax", steps=2, checkpoint_every=1,
                       **{**TINY, **kw})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train(_config(), out, progress=False)
    return out


def _plant(kind: str, path: Path, good: Path, marker: Path) -> None:
    """Write a bad file of ``kind`` at ``path`` (``good``: a real checkpoint to truncate)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "malicious":
        torch.save({"config": {}, "model": {}, "step": _Planted(marker)}, path)
    elif kind == "malicious-raw":
        path.write_bytes(pickle.dumps({"step": _Planted(marker)}))
    elif kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random":
        path.write_bytes(bytes(range(100)))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign":
        torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    else:
        raise AssertionError(kind)


ERRORS = {"malicious": "holds Python objects other than tensors and data",
          "malicious-raw": "not a readable",
          "truncated": "not a readable",
          "random": "not a readable",
          "empty": "empty file",
          "foreign": "not an effattn run checkpoint"}


def _resume(folder, **kw):
    return train(_config(), folder, progress=False, **kw)


def _init_from(folder, **kw):
    return train(_config(init_from=str(folder)), folder.parent / "fine-tuned", progress=False,
                 **kw)


def _load_run(folder, **kw):
    return load_run(folder, **kw)


def _convert_teacher(folder, **kw):
    plan = ConvertPlan(teacher=_config(), methods=[("linear", {})], teacher_dir=folder, **kw)
    return convert(plan, folder.parent / "converted", echo=False)


LOADERS = {"resume": _resume, "init_from": _init_from, "load_run": _load_run,
           "convert_teacher": _convert_teacher}


@pytest.mark.parametrize("kind", sorted(ERRORS))
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_every_loader_refuses_a_bad_checkpoint_and_runs_nothing(loader, kind, run_dir,
                                                                tmp_path):
    folder, marker = tmp_path / "run", tmp_path / "planted-code-ran"
    _plant(kind, folder / "checkpoint.pt", run_dir / "checkpoint.pt", marker)
    with pytest.raises(ValueError, match=ERRORS[kind]) as caught:
        LOADERS[loader](folder)
    assert isinstance(caught.value, CheckpointError)
    assert str(folder / "checkpoint.pt") in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["malicious", "truncated", "foreign"])
def test_a_task_data_cache_is_read_as_data(kind, run_dir, tmp_path):
    data = tmp_path / "data"
    make_task("listops", 32, 0, data_dir=data, **LISTOPS)  # writes the caches
    caches = sorted(data.glob("*.pt"))
    assert len(caches) == 3
    task = make_task("listops", 32, 0, data_dir=data, **LISTOPS)  # reads them back
    fresh = make_task("listops", 32, 0, data_dir=None, **LISTOPS)
    torch.testing.assert_close(task.eval_sets["test"], fresh.eval_sets["test"], rtol=0, atol=0)
    marker = tmp_path / "planted-code-ran"
    _plant(kind, caches[0], run_dir / "checkpoint.pt", marker)
    expected = "not a data cache" if kind == "foreign" else ERRORS[kind]
    with pytest.raises(CheckpointError, match=expected) as caught:
        make_task("listops", 32, 0, data_dir=data, **LISTOPS)
    assert "regenerated" in str(caught.value)
    assert not marker.exists()


def test_a_checkpoint_holds_only_data_and_says_its_format(run_dir):
    saved = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert saved["format"] == FORMAT and saved["version"] == VERSION
    assert {"config", "model", "optimizer", "torch_rng", "python_rng", "step"} <= set(saved)
    with zipfile.ZipFile(run_dir / "checkpoint.pt") as archive:
        assert archive.namelist()  # the zip format of torch.save


def test_the_format_before_the_marker_loads_and_a_newer_one_is_refused(run_dir, tmp_path):
    saved = load_checkpoint(run_dir / "checkpoint.pt")
    old = {k: v for k, v in saved.items() if k not in ("format", "version")}
    torch.save(old, tmp_path / "v1.pt")
    assert load_checkpoint(tmp_path / "v1.pt")["step"] == saved["step"]
    torch.save({**saved, "version": VERSION + 1}, tmp_path / "v3.pt")
    with pytest.raises(CheckpointError, match="newer effattn"):
        load_checkpoint(tmp_path / "v3.pt")
    torch.save({**saved, "format": "other-tool"}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not an effattn checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


@pytest.fixture
def older_run(run_dir, tmp_path):
    """A run folder whose checkpoint holds an object beyond data (a ``Path`` in its config, as
    an older effattn could write): real weights, unreadable by the restricted unpickler."""
    folder = tmp_path / "older"
    folder.mkdir()
    saved = load_checkpoint(run_dir / "checkpoint.pt")
    saved = {k: v for k, v in saved.items() if k not in ("format", "version")}
    saved["config"] = {**saved["config"], "device": "cpu"}
    saved["written_by"] = Path("/an/older/effattn")
    torch.save(saved, folder / "checkpoint.pt")
    return folder


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_an_older_checkpoint_loads_only_when_trusted(loader, older_run):
    with pytest.raises(CheckpointError, match=r"PosixPath.*--trust-checkpoint"):
        LOADERS[loader](older_run)
    kw = {"trust_checkpoint": True}
    with pytest.warns(UserWarning, match="full unpickler"):
        if loader == "convert_teacher":
            # The teacher loads; convert then refuses the task (copy is not an LM it measures).
            with pytest.raises(ValueError, match="convert measures"):
                LOADERS[loader](older_run, **kw)
        else:
            LOADERS[loader](older_run, **kw)


def test_resume_from_a_trusted_older_checkpoint_equals_the_run(run_dir, older_run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = load_run(older_run, trust_checkpoint=True)
    original = load_run(run_dir)
    torch.testing.assert_close(resumed.model.state_dict(), original.model.state_dict(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["malicious", "truncated", "foreign"])
@pytest.mark.parametrize("how", ["resume", "init-from", "teacher"])
def test_the_command_line_says_one_line_and_exits_2(how, kind, run_dir, tmp_path, capsys):
    folder, marker = tmp_path / "run", tmp_path / "planted-code-ran"
    _plant(kind, folder / "checkpoint.pt", run_dir / "checkpoint.pt", marker)
    if how == "teacher":
        argv = ["convert", "--teacher", str(folder), "--methods", "linear",
                "--out", str(tmp_path / "c")]
    else:
        argv = ["train", *CLI_TINY, "--steps", "2", "--out",
                str(folder if how == "resume" else tmp_path / "ft")]
        argv += ["--init-from", str(folder)] if how == "init-from" else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(ERRORS[kind], lines[0]), err
    assert str(folder / "checkpoint.pt") in lines[0]
    assert not marker.exists()


def test_trust_checkpoint_at_the_command_line(older_run, tmp_path, capsys):
    argv = ["train", *CLI_TINY, "--steps", "3", "--out", str(tmp_path / "ft"),
            "--init-from", str(older_run)]
    assert main(argv) == 2
    assert "--trust-checkpoint" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="full unpickler"):
        assert main([*argv, "--trust-checkpoint"]) == 0
    assert "initialised from" in (tmp_path / "ft" / "train.log").read_text()


def _loads(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls in ``tree`` that unpickle: ``torch.load`` (with its ``weights_only``) and any
    ``load``/``loads``/``Unpickler`` of pickle-like modules."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name == "torch.load":
            safe = [k.value for k in node.keywords if k.arg == "weights_only"]
            value = safe[0].value if safe and isinstance(safe[0], ast.Constant) else None
            out.append((node.lineno, f"torch.load(weights_only={value})"))
        elif re.fullmatch(r"(c?pickle|dill|joblib|marshal|shelve)\.(loads?|Unpickler|open)", name):
            out.append((node.lineno, name))
    return out


def test_only_the_opt_in_unpickles_arbitrary_objects():
    """The package unpickles in one module, the checkpoints': once with the restricted
    unpickler, and once with the full one, after the refusal of an untrusted file."""
    found = {path.relative_to(SRC).as_posix(): calls for path in SRC.rglob("*.py")
             if (calls := _loads(ast.parse(path.read_text())))}
    assert set(found) == {"tools/checkpoints.py"}, found
    assert sorted(call for _, call in found["tools/checkpoints.py"]) == [
        "torch.load(weights_only=False)", "torch.load(weights_only=True)"]
    text = (SRC / "tools" / "checkpoints.py").read_text()
    trusted = text.index("weights_only=False)")
    assert text.rfind("if not trust:", 0, trusted) != -1


def test_the_source_scan_finds_an_unsafe_load():
    planted = ast.parse("import pickle, torch\nx = torch.load(p, weights_only=False)\n"
                        "y = pickle.load(f)\nz = torch.load(p)\n")
    assert _loads(planted) == [(2, "torch.load(weights_only=False)"), (3, "pickle.load"),
                               (4, "torch.load(weights_only=None)")]
