"""Converting a trained softmax model: swap of effattn's own models, linearize, attention transfer,
``effattn train --init-from``, rebuilding a run, ``effattn convert``, and the documented
defaults."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import effattn
from effattn.cli import main
from effattn.convert import layer_errors, linearize, transfer
from effattn.nn import DecoderLM, MultiheadAttention, swap
from effattn.registry import DEFAULT_METHOD
from effattn.tools import convert as tools_convert
from effattn.tools.compare import run_options
from effattn.tools.runs import load_run
from effattn.tools.train import TASK_DEFAULTS, TrainConfig, evaluate, train

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
TINY = {"d_model": 16, "layers": 1, "heads": 2, "batch_size": 4, "seq_len": 24}
# A method with a learned feature map (what attention transfer trains) and one without any.
LEARNED = "hedgehog"
FIXED = "linear"


def _lm(seed=0, **kw):
    torch.manual_seed(seed)
    return DecoderLM(30, 16, 2, 2, max_len=32, seed=seed, **kw)


def _tokens(seed, shape=(3, 21)):
    return torch.randint(0, 30, shape, generator=torch.Generator().manual_seed(seed))


def test_swap_converts_effattn_models_keeping_weights():
    model = _lm()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    assert swap(model, FIXED) is model
    assert {layer.method for layer in model.modules() if isinstance(layer, MultiheadAttention)} \
        == {FIXED}
    after = dict(model.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # and back to softmax: the same outputs as the original model
    swap(model, DEFAULT_METHOD)
    x = _tokens(1)
    torch.testing.assert_close(model(x), _lm()(x), rtol=0, atol=0)


def test_swap_and_linearize_refuse_a_model_without_attention():
    with pytest.raises(ValueError, match="no attention layer to convert"):
        swap(nn.Sequential(nn.Linear(4, 4)), FIXED)
    with pytest.raises(ValueError, match="no attention layer to convert"):
        linearize(nn.Linear(4, 4), FIXED)


def test_linearize_keeps_every_weight_and_returns_the_new_parameters():
    model = _lm()
    before = copy.deepcopy(model.state_dict())
    new = linearize(model, LEARNED)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert sorted(new) == sorted(f"blocks.{i}.self_attn.attn.{p}" for i in (0, 1)
                                 for p in ("weight", "bias"))
    assert all(new[name] is p for name, p in model.named_parameters() if name in new)
    assert linearize(model, FIXED) == {}  # no parameters of its own; the old map is dropped
    assert not any(".attn." in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("kind", ["effattn", "torch"])
def test_linearize_to_softmax_leaves_outputs_unchanged(kind):
    if kind == "effattn":
        model, x = _lm().eval(), _tokens(2)
    else:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        model, x = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), \
            torch.randn(2, 9, 16)
    expected = model(x)
    assert linearize(model, DEFAULT_METHOD) == {}
    torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)


def test_linearize_errors_name_the_problem():
    with pytest.raises(KeyError, match="no_such_method"):
        linearize(_lm(), "no_such_method")
    cannot = [m for m in effattn.methods() if not effattn.spec(m).decoding]
    with pytest.raises(ValueError, match="cannot decode"):
        linearize(_lm(), cannot[0], decoding=True)
    assert linearize(_lm(), LEARNED, decoding=True)
    non_causal = [m for m in effattn.methods() if not effattn.spec(m).causal]
    with pytest.raises(ValueError, match="causal"):
        linearize(_lm(), non_causal[0])
    with pytest.raises(ValueError, match="from_torch"):
        linearize(nn.MultiheadAttention(8, 2), FIXED)


def test_transfer_lowers_the_layer_output_error_and_trains_only_the_new_parameters():
    model = _lm()
    new = linearize(model, LEARNED)
    frozen = {k: p.detach().clone() for k, p in model.named_parameters() if k not in new}
    probe = _tokens(99, (4, 31))
    before = layer_errors(model, probe)
    losses = transfer(model, (_tokens(s, (4, 31)) for s in range(20)), steps=20, parameters=new)
    after = layer_errors(model, probe)
    assert len(losses) == 20 and len(before) == 2
    assert sum(after) < 0.8 * sum(before), (before, after)
    now = dict(model.named_parameters())
    assert all(torch.equal(now[k], v) for k, v in frozen.items())
    assert all(p.requires_grad for p in model.parameters())


def test_transfer_by_weights_cross_entropy_lowers_it():
    # Hedgehog's loss: the cross-entropy of the attention weights, past the teacher's entropy.
    model = _lm()
    new = linearize(model, LEARNED)
    probe = _tokens(99, (4, 31))
    before = layer_errors(model, probe, "ce")
    losses = transfer(model, (_tokens(s, (4, 31)) for s in range(20)), steps=20,
                      parameters=new, loss="ce")
    after = layer_errors(model, probe, "ce")
    assert len(losses) == 20 and min(before) > 0.0
    assert sum(after) < 0.8 * sum(before), (before, after)


@pytest.mark.parametrize("method", ["local:window=64", "hedgehog:window=64"])
def test_weights_cross_entropy_is_zero_where_the_method_is_exact(method):
    # A window covering every key makes both exact softmax: their weights, read through the
    # method's own forward, match the teacher's, and so do their outputs.
    name, option = method.split(":")
    model = _lm()
    linearize(model, name, window=int(option.split("=")[1]))
    probe = _tokens(5, (2, 21))
    assert max(layer_errors(model, probe, "ce")) < 1e-5
    assert max(layer_errors(model, probe)) < 1e-10


def _hedgehog_kernel(attn, q, k):
    """φ(q)·φ(k) (B, H, N, N) of hedgehog's "exp" map written out: φ(x) = [e^u, e^-u], u = x W_h
    + b_h, in float64."""
    weight, bias = attn.weight.detach().double(), attn.bias.detach().double()

    def phi(x):
        u = torch.einsum("bhld,hdf->bhlf", x.double(), weight) + bias[:, None, :]
        return torch.cat([u.exp(), (-u).exp()], -1)

    return phi(q) @ phi(k).transpose(-2, -1)


def _expected_log_factor(attn, q, k, window):
    """log α_h = median over (b, i) of log Σ_{j ∉ W(i)} e^{s_ij} - log Σ_{j ∉ W(i)} κ(q_i, k_j),
    causal, from the dense logits and kernel in float64 (queries with no key outside skipped)."""
    n = q.shape[2]
    logits = attn.scale * q.double() @ k.double().transpose(-2, -1)
    offset = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    outside = offset >= window
    exact = torch.logsumexp(logits.masked_fill(~outside, -torch.inf), -1)
    estimate = _hedgehog_kernel(attn, q, k).masked_fill(~outside, 0.0).sum(-1).log()
    diff = (exact - estimate)[:, :, window:]  # (B, H, N - W): the queries with keys outside
    return diff.transpose(0, 1).flatten(1).median(-1).values


@pytest.mark.parametrize(("method", "calibrated"), [("performer", False), ("hedgehog", True)])
def test_transfer_calibrates_the_factor_only_of_maps_that_do_not_estimate_exp(method,
                                                                             calibrated):
    model = _lm()
    new = linearize(model, method, window=4, window_factor=True)
    seen = {}

    def keep(module, args, kwargs):  # the first q, k each layer gets: the calibration batch
        seen.setdefault(id(module), (args[0].detach(), args[1].detach()))

    layers = [m for m in model.modules() if getattr(m, "window_log_factor", None) is not None]
    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in layers]
    transfer(model, iter([_tokens(0, (4, 31))]), steps=1, parameters=new, lr=1e-9)
    for handle in handles:
        handle.remove()
    factors = torch.stack([m.window_log_factor.detach() for m in layers])
    assert factors.shape == (2, 2)
    if not calibrated:  # left at 1: at most lr away from log 1 = 0
        assert factors.abs().max() < 1e-6
        return
    # hedgehog's identity map has a kernel far larger than e^s: the factor is negative (about
    # -3 here), and it is the median log-ratio of softmax's mass outside the window to the
    # kernel's, on the q, k of the softmax model's hidden states.
    assert (factors < -0.5).all(), factors
    for attn, got in zip(layers, factors, strict=True):
        want = _expected_log_factor(attn, *seen[id(attn)], window=4)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_transfer_feeds_every_layer_the_softmax_models_hidden_states():
    """Each converted layer hands the teacher's output on: the second block gets the input it
    gets in the softmax model, not the one the first layer's method would give."""
    teacher = _lm().eval()
    model = _lm()
    new = linearize(model, LEARNED)
    x = _tokens(0, (4, 31))
    inputs = []

    def keep(module, args):
        inputs.append(args[0].detach().clone())

    handles = [m.blocks[1].register_forward_pre_hook(keep) for m in (teacher, model)]
    with torch.no_grad():
        teacher(x)
    transfer(model, iter([x]), steps=1, parameters=new)
    with torch.no_grad():  # outside transfer: the method's own hidden states
        model(x)
    for handle in handles:
        handle.remove()
    assert len(inputs) == 3
    torch.testing.assert_close(inputs[1], inputs[0], rtol=1e-5, atol=1e-6)
    # The method's own differ: the comparison above is not vacuous.
    assert (inputs[2] - inputs[0]).abs().max() > 1e-3


def test_transfer_by_default_trains_the_gate_projection_of_gated_rfa():
    """parameters=None: the mechanisms' own parameters and their call inputs' projections; gated
    RFA has no parameters of its own, only its gate projection, which is what linearize
    returned and what transfer trains."""
    model = _lm()
    new = linearize(model, "rfa", gated=True, num_features=8)
    assert sorted(new) == sorted(f"blocks.{i}.self_attn.gate_proj.{p}" for i in (0, 1)
                                 for p in ("weight", "bias"))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    transfer(model, (_tokens(s, (4, 31)) for s in range(3)), steps=3)
    changed = {k for k, p in model.named_parameters() if not torch.equal(p, before[k])}
    assert changed == set(new)


def test_transfer_refuses_what_it_cannot_train():
    model = _lm()
    with pytest.raises(ValueError, match="linearize it first"):
        transfer(model, iter([_tokens(0)]), steps=1)
    linearize(model, FIXED)
    with pytest.raises(ValueError, match="nothing to transfer"):
        transfer(model, iter([_tokens(0)]), steps=1)
    linearize(model, LEARNED)
    with pytest.raises(ValueError, match="loss must be one of mse, ce, got 'kl'"):
        transfer(model, iter([_tokens(0)]), steps=1, loss="kl")
    with pytest.raises(ValueError, match="ran out after 1 of 2"):
        transfer(model, iter([_tokens(0)]), steps=2)
    with pytest.raises(ValueError, match="steps"):
        transfer(model, iter([_tokens(0)]), steps=0)


@pytest.fixture(scope="module")
def softmax_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("softmax")
    cfg = TrainConfig(task="recall", steps=6, checkpoint_every=3, **TINY)
    return out, train(cfg, out, progress=False)


def test_load_run_rebuilds_the_trained_model(softmax_run, tmp_path):
    out, results = softmax_run
    run = load_run(out)
    assert run.step == 6 and run.config.method == DEFAULT_METHOD and not run.model.training
    assert evaluate(run.model, run.task, "test", run.device)["loss"] == pytest.approx(
        results["test"]["loss"], rel=1e-6)
    with pytest.raises(ValueError, match="no checkpoint.pt"):
        load_run(tmp_path)


def test_train_init_from_loads_every_matching_weight_and_names_the_new(softmax_run, tmp_path):
    source, _ = softmax_run
    cfg = TrainConfig(task="recall", method=LEARNED, steps=1, init_from=str(source), **TINY)
    results = train(cfg, tmp_path / "ft2", progress=False)
    init = results["init"]
    assert init["method"] == DEFAULT_METHOD and init["step"] == 6
    # the feature map's W and b, and the state of the generator that drew its init
    assert {"blocks.0.self_attn.attn.weight", "blocks.0.self_attn.attn.bias"} <= set(init["new"])
    assert all(k.startswith("blocks.0.self_attn.attn.") for k in init["new"])
    assert init["unused"] == [] and init["loaded"] > 0
    log = (tmp_path / "ft2" / "train.log").read_text()
    assert "initialised from" in log and "blocks.0.self_attn.attn.weight" in log


def test_init_from_failures_name_the_cause(softmax_run, tmp_path):
    source, _ = softmax_run
    with pytest.raises(ValueError, match="no checkpoint.pt"):
        TrainConfig(task="recall", init_from=str(tmp_path), **TINY).resolved()
    other_task = TrainConfig(task="copy", steps=1, init_from=str(source), **TINY)
    with pytest.raises(ValueError, match="a run of task recall, not copy"):
        train(other_task, tmp_path / "a", progress=False)
    wider = TrainConfig(task="recall", steps=1, init_from=str(source),
                        **{**TINY, "d_model": 32})
    with pytest.raises(ValueError, match="weights of another shape"):
        train(wider, tmp_path / "b", progress=False)


def test_train_help_documents_init_from(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--init-from DIR" in capsys.readouterr().out


CONVERT = ["convert", "--task", "recall", "--teacher-steps", "4", "--seq-len", "24",
           "--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "4",
           "--transfer-steps", "2", "--finetune-steps", "2", "--device", "cpu"]


def test_convert_writes_every_stage_and_resumes(tmp_path, capsys):
    argv = [*CONVERT, "--methods", LEARNED, FIXED, "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert all(set(r) == {"task", "method", "stage", "steps", "accuracy"} for r in rows)
    stages = [(r["method"].split(":")[0], r["stage"], r["steps"]) for r in rows]
    assert stages == [(DEFAULT_METHOD, "teacher", 4), (LEARNED, "swap", 0),
                      (LEARNED, "transfer", 2), (LEARNED, "finetune", 4),
                      (LEARNED, "scratch", 8), (FIXED, "swap", 0), (FIXED, "finetune", 2),
                      (FIXED, "scratch", 6)]
    assert all(0.0 <= r["accuracy"] <= 100.0 for r in rows)
    for name in ("results.csv", "convert.md", "convert.png"):
        assert (tmp_path / name).is_file()
    stamp = (tmp_path / "teacher" / "checkpoint.pt").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0  # everything done: nothing is trained again
    assert (tmp_path / "teacher" / "checkpoint.pt").stat().st_mtime_ns == stamp
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    # --teacher: the run folder of another softmax training
    other = tmp_path / "from-teacher"
    assert main([*CONVERT, "--methods", FIXED, "--stages", "swap", "--teacher",
                 str(tmp_path / "teacher"), "--out", str(other)]) == 0
    assert [r["stage"] for r in json.loads((other / "results.json").read_text())] == ["swap"]


def test_convert_transfer_by_weights_is_its_own_run(tmp_path, capsys):
    argv = [*CONVERT, "--methods", LEARNED, "--stages", "teacher,transfer,finetune",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    plain = json.loads((tmp_path / "results.json").read_text())
    assert main([*argv, "--transfer-loss", "ce"]) == 0  # the outputs' transfer is not reused
    rows = json.loads((tmp_path / "results.json").read_text())
    got = [(r["stage"], r.get("transfer")) for r in plain + rows if r["stage"] != "teacher"]
    assert got == [("transfer", None), ("finetune", None), ("transfer", "ce"),
                   ("finetune", "ce")]
    label = rows[1]["method"]
    assert {p.name for p in (tmp_path / label).iterdir()} == {
        "transfer", "finetune-2", "transfer-ce", "finetune-ce-2"}
    assert "(transfer ce)" in (tmp_path / "convert.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--transfer-loss", "kl"])
    assert "--transfer-loss" in capsys.readouterr().err


def _swapped(teacher_dir):
    """The teacher of ``teacher_dir`` switched to LEARNED as effattn convert does, with the first
    batch its transfer trains on (the training data after the teacher's)."""
    run = load_run(teacher_dir)
    cfg = run.config
    linearize(run.model, LEARNED, seed=cfg.seed, **run_options(LEARNED, {}, cfg))
    return run, run.task.train_batch(cfg.steps, cfg.batch_size)[0]


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_convert_transfer_optimises_the_loss_it_is_given(softmax_run, tmp_path, loss):
    """The first transfer loss effattn convert records is the one asked for, computed on the
    swapped model and the first transfer batch: the outputs' MSE or the weights' cross-entropy
    (different numbers: the one is not the other under another name)."""
    teacher_dir, _ = softmax_run
    plan = tools_convert.ConvertPlan(
        teacher=TrainConfig(task="recall", **TINY), teacher_dir=teacher_dir,
        methods=[(LEARNED, {})], transfer_steps=2, transfer_loss=loss, stages=("transfer",))
    rows = tools_convert.convert(plan, tmp_path, echo=False)
    folder = tmp_path / rows[0]["method"] / ("transfer-ce" if loss == "ce" else "transfer")
    recorded = json.loads((folder / "transfer.json").read_text())["losses"]
    run, first = _swapped(teacher_dir)
    want = {kind: sum(layer_errors(run.model, first, kind)) for kind in ("mse", "ce")}
    assert recorded[0] == pytest.approx(want[loss], rel=1e-5)
    other = want["ce" if loss == "mse" else "mse"]
    assert abs(other - want[loss]) > 0.1 * want[loss], want


def test_convert_finetunes_from_the_transfer_checkpoint(softmax_run, tmp_path):
    """Fine-tuning at a learning rate of 1e-12 leaves the model where it started: its test loss
    and score are the transfer checkpoint's (not the swapped teacher's)."""
    teacher_dir, _ = softmax_run
    plan = tools_convert.ConvertPlan(
        teacher=TrainConfig(task="recall", **TINY), teacher_dir=teacher_dir,
        methods=[(LEARNED, {})], transfer_steps=3, transfer_lr=0.3, finetune_steps=(1,),
        finetune_lr=1e-12, stages=("transfer", "finetune"))
    rows = tools_convert.convert(plan, tmp_path, echo=False)
    assert [r["stage"] for r in rows] == ["transfer", "finetune"]
    assert rows[1]["accuracy"] == rows[0]["accuracy"]
    folder = tmp_path / rows[0]["method"]
    tuned = json.loads((folder / "finetune-1" / "results.json").read_text())
    assert tuned["init"]["from"] == str(folder / "transfer")
    transferred = load_run(folder / "transfer")
    start = evaluate(transferred.model, transferred.task, "test", transferred.device)["loss"]
    assert tuned["test"]["loss"] == pytest.approx(start, rel=1e-6)
    run, _ = _swapped(teacher_dir)  # where a start from the teacher would be
    swapped = evaluate(run.model.eval(), run.task, "test", run.device)["loss"]
    assert abs(swapped - start) > 1e-4, (swapped, start)  # measured 9e-4


def test_convert_usage_errors_exit_2(tmp_path, capsys):
    assert main([*CONVERT, "--methods", "no_such_method", "--out", str(tmp_path)]) == 2
    assert "no_such_method" in capsys.readouterr().err
    non_causal = [m for m in effattn.methods() if not effattn.spec(m).causal][0]
    assert main([*CONVERT, "--methods", non_causal, "--out", str(tmp_path)]) == 2
    assert "cannot run recall" in capsys.readouterr().err
    assert main([*CONVERT, "--methods", FIXED, "--teacher", str(tmp_path),
                 "--out", str(tmp_path)]) == 2
    assert "no checkpoint.pt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*CONVERT, "--methods", FIXED, "--stages", "bogus"])


def test_ctrl_c_in_convert_exits_130_with_a_resume_hint(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("effattn.cli.convert.convert", interrupted)
    assert main([*CONVERT, "--methods", FIXED, "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "run the same command again to resume" in err


def test_convert_table_marks_the_change_against_the_teacher():
    rows = [{"task": "charlm", "method": DEFAULT_METHOD, "stage": "teacher", "steps": 10,
             "bpc": 2.0},
            {"task": "charlm", "method": "m", "stage": "transfer", "steps": 3, "bpc": 2.2},
            {"task": "charlm", "method": "m", "stage": "finetune", "steps": 8, "bpc": 2.1}]
    text = tools_convert.table(rows)
    assert "| `m` | - | 2.200 (+10.0%) @3 | 2.100 (+5.0%) @8 | - |" in text
    assert "finetune (+5)" in text


def test_docs_give_the_task_defaults_the_code_uses():
    """docs/training.md's default budget names each task's learning rate as TASK_DEFAULTS does."""
    text = (ROOT / "docs" / "training.md").read_text()
    budget = text[text.index("### Default budget"):text.index("### What the table means")]
    for task, defaults in TASK_DEFAULTS.items():
        line = next(line for line in budget.splitlines() if line.startswith(f"| {task} "))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1:4] == [str(defaults["seq_len"]), str(defaults["steps"]),
                              f"{defaults['lr']:g}"], (task, cells)
    assert re.search(r"warm-up min\(100, steps/10\) steps", budget)
