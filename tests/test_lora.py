"""LoRA adapters on the attention projections (effattn.convert.lora, merge_lora) and fine-tuning
with them (``effattn train --lora-rank``, ``effattn convert --finetune lora``)."""

import json

import pytest
import torch
from torch import nn

from effattn.cli import main
from effattn.convert import LoRA, linearize, lora, merge_lora
from effattn.nn import DecoderLM
from effattn.tools import convert as tools_convert
from effattn.tools.runs import load_run
from effattn.tools.train import TrainConfig, evaluate, train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"d_model": 16, "layers": 1, "heads": 2, "batch_size": 4, "seq_len": 24}


def _lm(method="softmax"):
    torch.manual_seed(0)
    return DecoderLM(30, 18, 3, 2, method=method, max_len=70, seed=0).double()


def _torch_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(21, 3, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()


def _tokens(n=63):
    return torch.randint(0, 30, (2, n), generator=torch.Generator().manual_seed(1))


def _randomize(adapters):
    with torch.no_grad():
        for p in adapters.values():
            p.normal_(0, 0.3)


@pytest.mark.parametrize("kind", ["effattn", "effattn-hedgehog", "torch"])
def test_lora_starts_as_the_model_and_merges_to_the_same_function(kind):
    if kind == "torch":
        model, x, width = _torch_encoder(), torch.randn(2, 63, 21, dtype=torch.float64), 21
    else:
        model, x, width = _lm(), _tokens(), 18
        if kind == "effattn-hedgehog":
            linearize(model, "hedgehog")
            model.double()
    model.train()
    before = model(x)
    adapters = lora(model, rank=4, alpha=8)
    # per layer: q, k, v (one packed weight, an adapter per block) and the output projection
    assert len(adapters) == 2 * 2 * 2
    packed = [p for n, p in adapters.items() if "in_proj_weight" in n and n.endswith("lora_A")]
    assert packed and all(p.shape == (3, 4, width) for p in packed)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    _randomize(adapters)
    adapted = model(x)
    assert (adapted - before).abs().max() > 1e-3
    assert merge_lora(model) == 4
    assert not any(isinstance(m, LoRA) for m in model.modules())
    assert not any("lora" in k or "parametrizations" in k for k in model.state_dict())
    torch.testing.assert_close(model(x), adapted, rtol=1e-12, atol=1e-12)
    assert merge_lora(model) == 0


def test_only_the_adapters_get_gradients_and_they_live_in_the_state_dict():
    model, x = _lm(), _tokens(21)
    adapters = lora(model, rank=2)
    _randomize(adapters)
    model(x).square().mean().backward()
    for name, p in model.named_parameters():
        if name in adapters:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name
    state = model.state_dict()
    assert set(adapters) <= set(state)
    other = _lm()
    lora(other, rank=2)
    other.load_state_dict(state)
    torch.testing.assert_close(other(x), model(x))


def test_lora_adapts_hugging_face_style_projections():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))
            self.o_proj = nn.Linear(8, 8)

    model = nn.Sequential(Attention(), nn.Linear(8, 8))
    adapters = lora(model, rank=2)
    assert sorted({n.split(".")[1] for n in adapters}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert not model[1].weight.requires_grad


def test_lora_errors_name_the_problem():
    with pytest.raises(ValueError, match="rank must be a positive int"):
        lora(_lm(), rank=0)
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        lora(_lm(), alpha=0)
    with pytest.raises(ValueError, match="no attention projections"):
        lora(nn.Sequential(nn.Linear(4, 4)))
    model = _lm()
    lora(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora(model)


@pytest.fixture(scope="module")
def softmax_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("softmax")
    train(TrainConfig(task="recall", steps=4, **TINY), out, progress=False)
    return out


def test_train_with_lora_trains_the_adapters_alone_and_resumes(softmax_run, tmp_path):
    cfg = TrainConfig(task="recall", method="hedgehog", steps=4, checkpoint_every=2,
                      init_from=str(softmax_run), lora_rank=2, **TINY)
    assert train(cfg, tmp_path / "a", progress=False, stop_after=2) is None
    resumed = train(cfg, tmp_path / "a", progress=False)
    straight = train(cfg, tmp_path / "b", progress=False)
    assert resumed["losses"] == straight["losses"]
    # a layer's packed q, k, v (3 blocks) and output projection, rank 2, width 16
    assert straight["trained_parameters"] == 3 * (2 * 16 + 16 * 2) + (2 * 16 + 16 * 2)
    run = load_run(tmp_path / "b")
    assert run.config.lora_rank == 2
    score = evaluate(run.model, run.task, "test", run.device)["loss"]
    assert score == pytest.approx(straight["test"]["loss"], rel=1e-6)
    merge_lora(run.model)
    assert evaluate(run.model, run.task, "test", run.device)["loss"] == pytest.approx(
        score, rel=1e-5)
    with pytest.raises(ValueError, match="a run with LoRA adapters"):
        train(TrainConfig(task="recall", steps=1, init_from=str(tmp_path / "b"), **TINY),
              tmp_path / "c", progress=False)


def test_lora_rank_needs_init_from_and_is_documented(capsys):
    with pytest.raises(ValueError, match="needs init_from"):
        TrainConfig(task="recall", lora_rank=2, **TINY).resolved()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--lora-rank R" in capsys.readouterr().out


def test_convert_finetunes_full_and_lora(tmp_path, capsys):
    argv = ["convert", "--task", "recall", "--teacher-steps", "3", "--seq-len", "24",
            "--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "4",
            "--transfer-steps", "1", "--finetune-steps", "2", "--device", "cpu",
            "--stages", "teacher,transfer,finetune", "--finetune", "full,lora",
            "--lora-rank", "2", "--methods", "hedgehog", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    tuned = [r for r in rows if r["stage"] == "finetune"]
    assert [(r["steps"], r.get("finetune")) for r in tuned] == [
        (3, None), (3, "lora:rank=2,alpha=16,lr=0.003")]
    label = rows[1]["method"]
    assert (tmp_path / label / "finetune-2").is_dir()
    assert (tmp_path / label / "finetune-lora-r2-2").is_dir()
    assert "finetune lora:rank=2,alpha=16,lr=0.003 (+2)" in tools_convert.table(rows)
    with pytest.raises(SystemExit):
        main([*argv, "--finetune", "bogus"])
