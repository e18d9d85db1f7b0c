"""Training: every method learns, resume equals an uninterrupted run, the CLI and compare."""

import json

import pytest
import torch
import torch.nn.functional as F

import effattn
from effattn.cli import main
from effattn.cli.common import parse_entry, parse_options
from effattn.nn import DecoderLM, EncoderClassifier
from effattn.tools import compare as cmp
from effattn.tools.checkpoints import load_checkpoint
from effattn.tools.train import TrainConfig, applicability, learning_rate, train

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = {"d_model": 16, "layers": 1, "heads": 2, "batch_size": 4, "seq_len": 24}
LISTOPS_SMALL = {"train_size": 64, "valid_size": 8, "test_size": 16}


def _variants():
    out = [(m, {}) for m in effattn.methods()]
    if "rfa" in effattn.methods() and "gated" in effattn.spec("rfa").options:
        out.append(("rfa", {"gated": True}))
    return out


def _fit(model, inputs, targets, steps=25):
    """Loss before and after ``steps`` Adam steps on one fixed batch (memorisation)."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("method, options", _variants(), ids=lambda v: str(v))
def test_every_method_learns_a_fixed_batch(method, options):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if not options.get("gated"):
        model = EncoderClassifier(12, 4, 16, 2, 1, method, max_len=24, seed=0, **options)
        inputs = torch.randint(1, 12, (8, 24), generator=g)
        losses = _fit(model, inputs, torch.randint(0, 4, (8,), generator=g))
        assert losses[-1] < 0.85 * losses[0], losses
    if effattn.spec(method).causal:
        model = DecoderLM(12, 16, 2, 1, method, max_len=24, seed=0, **options)
        tokens = torch.randint(0, 12, (4, 25), generator=g)
        losses = _fit(model, tokens[:, :-1], tokens[:, 1:])
        assert losses[-1] < 0.85 * losses[0], losses


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def _config(method="softmax", options=None, **kw):
    base = {"task": "listops", "method": method, "options": options or {}, "steps": 6,
            "checkpoint_every": 2, "task_options": LISTOPS_SMALL, **TINY}
    return TrainConfig(**{**base, **kw})


def _same_results(a, b):
    assert a["losses"] == b["losses"]
    assert a["test"] == b["test"] and a["valid"] == b["valid"]


@pytest.mark.parametrize("method, options", _variants(), ids=lambda v: str(v))
def test_resume_after_interruption_equals_uninterrupted_run(method, options, tmp_path,
                                                            data_dir):
    task = "listops" if applicability("listops", method, options) is None else "copy"
    cfg = _config(method, options, task=task, dropout=0.1,
                  task_options=LISTOPS_SMALL if task == "listops" else {"test_size": 8,
                                                                       "valid_size": 4})
    whole = train(cfg, tmp_path / "whole", data_dir=data_dir, progress=False)
    # Interrupted after step 5: the last checkpoint is at step 4, so step 5 is redone.
    assert train(cfg, tmp_path / "cut", data_dir=data_dir, stop_after=5, progress=False) is None
    assert not (tmp_path / "cut" / "results.json").exists()
    resumed = train(cfg, tmp_path / "cut", data_dir=data_dir, resume=True, progress=False)
    _same_results(whole, resumed)
    a = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["model"]
    torch.testing.assert_close(b, a, rtol=0, atol=0)  # parameters, buffers and random state
    log = (tmp_path / "cut" / "train.log").read_text()
    assert "resumed from step 4" in log


def test_checkpoint_of_an_older_version_is_refused(tmp_path, data_dir):
    cfg = _config()
    assert train(cfg, tmp_path, data_dir=data_dir, stop_after=2, progress=False) is None
    saved = load_checkpoint(tmp_path / "checkpoint.pt")
    torch.save({**saved, "hidden": {}}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="older effattn"):
        train(cfg, tmp_path, data_dir=data_dir, progress=False)


def test_results_json_and_logs(tmp_path, data_dir):
    cfg = _config(eval_every=3)
    results = train(cfg, tmp_path, data_dir=data_dir, progress=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["score"] == results["score"] and 0 <= saved["score"] <= 1
    assert saved["metric"] == "accuracy" and saved["config"]["steps"] == 6
    assert saved["steps_per_s"] > 0 and saved["peak_memory_mb"] >= 0
    assert len(saved["losses"]) == 6 and saved["parameters"] > 0
    events = [json.loads(line)["event"]
              for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert events.count("eval") == 1 and events[-1] == "done"
    assert not list(tmp_path.glob(".*tmp*"))


def test_charlm_reports_bits_per_character(tmp_path):
    cfg = TrainConfig(task="charlm", steps=2, checkpoint_every=2, **TINY,
                      task_options={"valid_windows": 2, "test_windows": 3})
    results = train(cfg, tmp_path, progress=False)
    assert results["metric"] == "bpc"
    assert results["score"] == pytest.approx(results["test"]["loss"] / 0.6931471805599453)
    assert results["task_info"]["eval_chars"]["test"] == 3 * 24
    assert 2 < results["score"] < 9


def test_bad_configurations(tmp_path, data_dir):
    with pytest.raises(ValueError, match="steps"):
        train(_config(steps=0), tmp_path, progress=False)
    with pytest.raises(ValueError, match="unknown task"):
        train(_config(task="nope"), tmp_path, progress=False)
    with pytest.raises(ValueError, match="divisible"):
        train(_config(d_model=18, heads=4), tmp_path, progress=False)
    with pytest.raises(KeyError, match="valid names"):
        train(_config("nope"), tmp_path, progress=False)
    with pytest.raises(ValueError, match="does not exist"):
        train(_config(), tmp_path / "empty", resume=True, progress=False)
    train(_config(steps=2), tmp_path / "a", data_dir=data_dir, progress=False)
    with pytest.raises(ValueError, match="steps: checkpoint 2 != now 4"):
        train(_config(steps=4), tmp_path / "a", data_dir=data_dir, progress=False)
    with pytest.raises(ValueError, match="exists"):
        train(_config(steps=2), tmp_path / "a", data_dir=data_dir, resume=False, progress=False)
    non_causal = [m for m in effattn.methods() if not effattn.spec(m).causal]
    for method in non_causal:
        assert effattn.spec(method).refusals["causal"] in applicability("charlm", method)
        with pytest.raises(ValueError, match="cannot run task charlm"):
            train(_config(method, task="charlm"), tmp_path / method, progress=False)


def test_learning_rate_schedule():
    cfg = _config(steps=1000, lr=1.0).resolved()
    assert learning_rate(cfg, 0) == pytest.approx(0.01)
    assert learning_rate(cfg, 99) == pytest.approx(1.0)
    assert learning_rate(cfg, 999) == pytest.approx(0.1, abs=1e-4)


def test_cli_train_and_errors(tmp_path, capsys):
    argv = ["train", "--task", "copy", "--method", "softmax", "--steps", "3", "--d-model", "16",
            "--heads", "2", "--layers", "1", "--batch-size", "4", "--seq-len", "16",
            "--device", "cpu", "--task-option", "test_size=8", "--task-option", "valid_size=4",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    assert "test accuracy" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "results.json").read_text())["config"]["steps"] == 3
    assert main(argv) == 0  # a finished run: resumes at its last step and re-evaluates
    assert main([*argv[:-1], str(tmp_path / "other"), "--resume"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--method", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "valid names" in capsys.readouterr().err
    assert main(["train", "--option", "novalue", "--out", str(tmp_path / "x")]) == 2
    assert "key=value" in capsys.readouterr().err


def test_compare_options_and_resolution():
    defaults = {"a": 0, "b": False, "c": "s", "d": 1.0}
    assert parse_options("a=1,b=true,c=x,d=0.5", defaults) == {
        "a": 1, "b": True, "c": "x", "d": 0.5}
    assert parse_entry("softmax") == ("softmax", {})
    with pytest.raises(KeyError):
        parse_entry("nope:x=1")
    run, skipped = cmp.resolve("charlm", [*cmp.every_variant(), parse_entry("softmax")])
    labels = [m for m, _ in run]
    assert labels.count("softmax") == 1
    for method in effattn.methods():
        assert (method in labels) == effattn.spec(method).causal
        if not effattn.spec(method).causal:
            assert effattn.spec(method).refusals["causal"] in skipped[method]
    for method in effattn.methods():
        opts = cmp.scaled_options(method, 256, 16)
        assert set(opts) <= set(effattn.spec(method).options)
    if "performer" in effattn.methods():
        assert cmp.scaled_options("performer", 256, 16)["num_features"] == 64
        assert "window" not in cmp.scaled_options("performer", 256, 16)  # the hybrid is opt-in
        assert cmp.run_options("performer", {"window": 64}, cmp.TrainConfig())["window"] == 64
    if "local" in effattn.methods():
        assert cmp.scaled_options("local", 256, 16)["window"] == 32
    if "linformer" in effattn.methods():
        assert cmp.scaled_options("linformer", 256, 16)["proj_len"] == 64


def test_compare_writes_table_json_csv_png_and_reuses_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    entries = ["softmax", "softmax:scale=0.5"]
    argv = ["compare", "--task", "listops", "--methods", *entries, "--steps", "2",
            "--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "4",
            "--seq-len", "24", "--device", "cpu", "--out", str(tmp_path)]
    for key, value in LISTOPS_SMALL.items():
        argv += ["--task-option", f"{key}={value}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| `softmax` |" in out and "36.37" in out and "`softmax:scale=0.5`" in out
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert [r["label"] for r in summary["rows"]] == entries
    assert summary["budget"]["steps"] == 2
    csv_lines = (tmp_path / "compare.csv").read_text().splitlines()
    assert csv_lines[0].startswith("label,metric,score") and len(csv_lines) == 3
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    stamp = (tmp_path / "softmax" / "results.json").stat().st_mtime_ns
    assert main(argv) == 0  # cached: not retrained
    assert (tmp_path / "softmax" / "results.json").stat().st_mtime_ns == stamp
