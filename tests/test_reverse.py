"""The reversal task: labels, streams, training an EncoderDecoder, greedy decoding at length."""

import json

import pytest
import torch

import effattn
from effattn.cli import main
from effattn.nn import EncoderDecoder
from effattn.tools import compare as cmp
from effattn.tools.tasks import synthetic
from effattn.tools.tasks.data import decoder_inputs, make_task
from effattn.tools.train import TrainConfig, applicability, greedy_scores, train

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = {"d_model": 16, "layers": 1, "heads": 2, "batch_size": 8, "seq_len": 12}
SMALL_SETS = {"valid_size": 8, "test_size": 16, "length_size": 8}
GATED = ("rfa", {"gated": True})


def _reference_target(source):
    """The target read independently of the generator: the symbols before padding, reversed,
    then EOS."""
    symbols = []
    for token in source:
        if token == synthetic.PAD:
            break
        symbols.append(token)
    return list(reversed(symbols)) + [synthetic.EOS]


def test_reverse_targets_match_pythons_reversed():
    x, y = synthetic.reverse_task(200, seed=3, min_len=4, max_len=9, digits=10)
    assert x.shape == (200, 9) and y.shape == (200, 10)
    lengths = set()
    for source, target in zip(x.tolist(), y.tolist(), strict=True):
        expected = _reference_target(source)
        n = len(expected) - 1
        lengths.add(n)
        assert target[:n + 1] == expected
        assert all(t == synthetic.IGNORE for t in target[n + 1:])
        assert all(t == synthetic.PAD for t in source[n:])  # padding only at the end
        assert all(synthetic.SPECIALS <= t < synthetic.SPECIALS + 10 for t in source[:n])
    assert lengths == set(range(4, 10))


def test_reverse_is_deterministic_and_checks_arguments():
    a = synthetic.reverse_task(8, seed=5, min_len=2, max_len=6)
    b = synthetic.reverse_task(8, seed=5, min_len=2, max_len=6)
    c = synthetic.reverse_task(8, seed=6, min_len=2, max_len=6)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="min_len"):
        synthetic.reverse_task(1, seed=0, min_len=5, max_len=4)
    with pytest.raises(ValueError, match="min_len"):
        synthetic.reverse_task(1, seed=0, min_len=0, max_len=4)
    with pytest.raises(ValueError, match="digits"):
        synthetic.reverse_task(1, seed=0, min_len=1, max_len=4, digits=1)


def test_reverse_task_streams_and_length_sets():
    task = make_task("reverse", 32, seed=1)
    again = make_task("reverse", 32, seed=1)
    assert task.kind == "seq2seq" and task.metric == "exact_match"
    assert task.info["min_len"] == 8 and task.info["max_len"] == 16
    assert all(torch.equal(u, v) for u, v in zip(task.train_batch(4, 8), again.train_batch(4, 8),
                                                  strict=True))
    assert not torch.equal(task.train_batch(4, 8)[0], task.train_batch(5, 8)[0])
    assert torch.equal(task.eval_sets["test"][1], again.eval_sets["test"][1])
    assert not torch.equal(task.eval_sets["test"][0][:256], task.eval_sets["valid"][0])
    for k in (1, 2, 4):
        sources, targets = task.length_sets[f"{k}x"]
        assert sources.shape == (256, 16 * k) and bool((sources != synthetic.PAD).all())
        assert bool((targets[:, -1] == synthetic.EOS).all())
    assert task.model_len == 4 * 16 + 1
    # Teacher forcing: BOS, then the targets shifted right, with padding after EOS.
    _, targets = task.train_batch(0, 8)
    inputs = decoder_inputs(task, targets)
    assert bool((inputs[:, 0] == synthetic.BOS).all()) and inputs.shape == targets.shape
    scored = targets[:, :-1] != synthetic.IGNORE
    assert torch.equal(inputs[:, 1:][scored], targets[:, :-1][scored])
    assert bool((inputs[:, 1:][~scored] == synthetic.PAD).all())


def test_applicability_needs_causal_cross_and_decoding():
    run, skipped = cmp.resolve("reverse", cmp.every_variant())
    labels = [effattn.spec(m).name for m, _ in run]
    for method in effattn.methods():
        s = effattn.spec(method)
        can = s.causal and s.cross and s.decoding
        assert (method in labels) == can, method
        if not can:
            reason = skipped[method]
            assert any(s.refusals[c] in reason for c in ("causal", "cross", "decoding")
                       if not getattr(s, c))
    assert GATED in run
    # The model itself refuses, with the spec's reason.
    no_cross = next(m for m in effattn.methods()
                    if effattn.spec(m).causal and not effattn.spec(m).cross)
    with pytest.raises(ValueError, match="cross"):
        EncoderDecoder(13, 13, 16, 2, 1, no_cross)
    assert effattn.spec(no_cross).refusals["cross"] in applicability("reverse", no_cross)


def _naive_greedy(model, src, steps):
    """Greedy decoding by the full forward over the growing target, no decoding state."""
    out = torch.full((len(src), 1), synthetic.BOS)
    with torch.no_grad():
        for _ in range(steps):
            out = torch.cat((out, model(src, out)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return out[:, 1:]


@pytest.mark.parametrize("method, options", [("softmax", {}), GATED], ids=str)
def test_greedy_scores_match_a_naive_decoder(method, options):
    task = make_task("reverse", 12, seed=0, **SMALL_SETS)
    model = EncoderDecoder(task.vocab_size, task.vocab_size, 16, 2, 1, method, seed=0,
                           **options).eval()
    sources, targets = task.eval_sets["test"]
    scores = greedy_scores(model, task, sources, targets, torch.device("cpu"), batch_size=5)
    decoded = _naive_greedy(model, sources, targets.shape[1])
    scored = targets != synthetic.IGNORE
    right = (decoded == targets) | ~scored
    assert scores["token_accuracy"] == pytest.approx(float((right & scored).sum() / scored.sum()))
    assert scores["exact_match"] == pytest.approx(float(right.all(1).float().mean()))
    assert scores["tokens_per_s"] > 0


def _config(method, options, **kw):
    base = {"task": "reverse", "method": method, "options": options, "steps": 6,
            "checkpoint_every": 2, "task_options": SMALL_SETS, **TINY}
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("method, options", [("softmax", {}), GATED], ids=str)
def test_tiny_run_learns(method, options, tmp_path):
    results = train(_config(method, options, steps=80, lr=1e-2), tmp_path, progress=False)
    losses = results["losses"]
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10]), losses
    assert results["metric"] == "exact_match"
    assert results["score"] == results["test"]["exact_match"]
    assert results["test"]["accuracy"] > 0.2  # teacher-forced token accuracy; chance is 1/11
    decoding = results["decoding_at_length"]
    assert list(decoding) == ["test", "1x", "2x", "4x"]
    assert decoding["test"]["exact_match"] == results["test"]["exact_match"]
    assert (decoding["test"]["min_len"], decoding["test"]["max_len"]) == (3, 6)
    assert decoding["4x"]["min_len"] == decoding["4x"]["max_len"] == 24
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["set"] for e in events if e["event"] == "decode"] == list(decoding)


@pytest.mark.parametrize("method, options", [("softmax", {}), GATED], ids=str)
def test_resume_equals_uninterrupted_run(method, options, tmp_path):
    cfg = _config(method, options, dropout=0.1)
    whole = train(cfg, tmp_path / "whole", progress=False)
    assert train(cfg, tmp_path / "cut", stop_after=5, progress=False) is None
    resumed = train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert whole["losses"] == resumed["losses"]
    assert whole["test"] == resumed["test"] and whole["valid"] == resumed["valid"]
    for name, r in whole["decoding_at_length"].items():
        other = resumed["decoding_at_length"][name]
        assert {k: v for k, v in r.items() if k != "tokens_per_s"} == \
            {k: v for k, v in other.items() if k != "tokens_per_s"}


def test_cli_compare_lists_methods_that_cannot_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    no_cross = next(m for m in effattn.methods()
                    if effattn.spec(m).causal and not effattn.spec(m).cross)
    argv = ["compare", "--task", "reverse", "--methods", "softmax", no_cross, "--steps", "2",
            "--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "4",
            "--seq-len", "12", "--device", "cpu", "--out", str(tmp_path)]
    for key, value in SMALL_SETS.items():
        argv += ["--task-option", f"{key}={value}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "test exact match (%)" in out and "exact match at 4x (%)" in out
    assert f"| `{no_cross}` | skipped: cannot cross-attend: " in out
    assert effattn.spec(no_cross).refusals["cross"] in out
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert [r["label"] for r in summary["rows"]] == ["softmax"]
    assert set(summary["rows"][0]["exact_match_at"]) == {"1x", "2x", "4x"}
