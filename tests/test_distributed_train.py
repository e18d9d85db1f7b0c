"""`effattn train` on several processes: the same run as one process, up to rounding.

torchrun launches 2 gloo workers on the CPU (a few seconds each, mostly imports). Each run is
checked against `train` in this process with the same configuration: the loss and the
gradient's norm at every step (the first step's gradient included: a wrong scale or a missing
part of the gradient changes the norm, which Adam's update would hide), the parameters after
the last step and the held-out metrics. Error cases start the two ranks by hand, so that each
exits on its own (torchrun stops the others once one fails).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from effattn.distributed.training import World, split_sequences
from effattn.nn import DecoderLM
from effattn.tools.checkpoints import load_checkpoint
from effattn.tools.train import TrainConfig, check_parallel, train

pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="needs torch.distributed with the gloo backend"),
    pytest.mark.usefixtures("one_thread"),
]

SRC = Path(__file__).resolve().parents[1] / "src"
TIMEOUT = 120  # seconds for a launch; each takes about 10 on two busy cores
TINY = {"task": "copy", "steps": 4, "d_model": 16, "heads": 2, "layers": 1, "batch_size": 4,
        "seq_len": 11, "checkpoint_every": 2, "task_options": {"test_size": 8, "valid_size": 4}}


def _config(method, options):
    return TrainConfig(method=method, options=options, **TINY)


def _argv(cfg, out, *extra):
    argv = ["--task", cfg.task, "--method", cfg.method, "--out", str(out), "--device", "cpu"]
    for name in ("steps", "d_model", "heads", "layers", "batch_size", "seq_len",
                 "checkpoint_every"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(cfg, name))]
    argv += [a for k, v in cfg.options.items() for a in ("--option", f"{k}={v}")]
    argv += [a for k, v in cfg.task_options.items() for a in ("--task-option", f"{k}={v}")]
    return [*argv, *extra]


def _env():
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def _torchrun(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "effattn", "train", *argv],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _by_hand(argvs):
    """Start rank r with argvs[r] under torchrun's environment; (exit code, stdout, stderr) of
    each. A rank still running after TIMEOUT is killed and fails the test (a hang)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(len(argvs))}
    procs = [subprocess.Popen([sys.executable, "-m", "effattn", "train", *argv],
                              env={**common, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, argv in enumerate(argvs)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outputs, strict=True)]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank hung")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _grad_norms(out):
    return [r["grad_norm"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
            if r["event"] == "train"]


def _assert_same_run(out, one, reference):
    """The run in ``out`` equals the one-process run ``one`` (its results ``reference``)."""
    got = json.loads((out / "results.json").read_text())
    assert got["config"] == reference["config"]
    torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(_grad_norms(out), _grad_norms(one), rtol=1e-5, atol=0)
    for split in ("valid", "test"):
        torch.testing.assert_close(got[split], reference[split], rtol=1e-5, atol=0)
    a = load_checkpoint(out / "checkpoint.pt")
    b = load_checkpoint(one / "checkpoint.pt")
    assert a["step"] == b["step"] == TINY["steps"]
    torch.testing.assert_close(a["model"], b["model"], rtol=1e-5, atol=1e-6)
    return got


def _one_line_from_rank_0(proc, parallel):
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and f"on 2 processes ({parallel} parallel)" in lines[0], proc.stdout


def test_data_parallel_equals_one_process_and_resumes_from_a_checkpoint(tmp_path):
    # rfa redraws its random features at every training call: the ranks must stay in step.
    cfg = _config("rfa", {"num_features": 16})
    reference = train(cfg, tmp_path / "one", progress=False)
    proc = _torchrun(_argv(cfg, tmp_path / "ddp"))
    _one_line_from_rank_0(proc, "data")
    got = _assert_same_run(tmp_path / "ddp", tmp_path / "one", reference)
    assert got["processes"] == {"parallel": "data", "count": 2}
    assert not list((tmp_path / "ddp").glob(".*tmp*"))

    # Interrupted at step 2 in one process, resumed on two: every rank loads the checkpoint.
    assert train(cfg, tmp_path / "cut", stop_after=2, progress=False) is None
    _torchrun(_argv(cfg, tmp_path / "cut"))
    assert "resumed from step 2" in (tmp_path / "cut" / "train.log").read_text()
    _assert_same_run(tmp_path / "cut", tmp_path / "one", reference)


def test_sequence_parallel_equals_one_process(tmp_path):
    # Gated rfa: gates and redraws cross the ranks; N = 11 splits into slices of 6 and 5.
    cfg = _config("rfa", {"num_features": 16, "gated": True})
    reference = train(cfg, tmp_path / "one", progress=False)
    proc = _torchrun(_argv(cfg, tmp_path / "sp", "--sequence-parallel"))
    _one_line_from_rank_0(proc, "sequence")
    got = _assert_same_run(tmp_path / "sp", tmp_path / "one", reference)
    assert got["processes"] == {"parallel": "sequence", "count": 2}


def test_bad_setups_end_every_rank_with_one_line_and_exit_2(tmp_path):
    cfg = _config("softmax", {})
    # Found before the process group starts: no rank waits for another.
    refused = _argv(_config("reformer", {}), tmp_path / "a", "--sequence-parallel")
    uneven = _argv(cfg, tmp_path / "b", "--batch-size", "3")
    # Found by rank 0 alone, after the group started (rank 1's --out holds no checkpoint):
    # the ranks agree before the first collective, and rank 1 names rank 0's error.
    assert train(cfg, tmp_path / "c0", stop_after=2, progress=False) is None
    other = _argv(_config("softmax", {}), tmp_path / "c0", "--lr", "0.5")
    cases = [([refused] * 2, ["reformer cannot be split along the sequence"] * 2),
             ([uneven] * 2, ["batch_size=3 must be divisible by the 2 processes"] * 2),
             ([other, _argv(cfg, tmp_path / "c1", "--lr", "0.5")],
              ["written by a different configuration",
               "rank 0 failed: " + str(tmp_path / "c0" / "checkpoint.pt")])]
    for argvs, messages in cases:
        for (code, out, err), message in zip(_by_hand(argvs), messages, strict=True):
            assert code == 2 and out == "", (code, out, err)
            assert err.count("\n") == 1 and err.startswith("effattn train: error: "), err
            assert message in err, err


def test_checks_that_need_the_number_of_processes():
    data = World(rank=1, size=2, distributed=True)
    sequence = World(rank=1, size=2, sequence_parallel=True, distributed=True)
    with pytest.raises(ValueError, match="batch_size=3 must be divisible by the 2 processes"):
        check_parallel(TrainConfig(batch_size=3).resolved(), data)
    check_parallel(TrainConfig(task="copy", batch_size=3).resolved(), sequence)  # not split
    with pytest.raises(ValueError, match="DecoderLM .*; listops trains an EncoderClassifier"):
        check_parallel(TrainConfig().resolved(), sequence)
    with pytest.raises(ValueError, match="nystrom cannot be split along the sequence"):
        check_parallel(TrainConfig(task="copy", method="nystrom").resolved(), sequence)
    with pytest.raises(ValueError, match="seq_len=4 is shorter than the 8 processes"):
        check_parallel(TrainConfig(task="copy", seq_len=4).resolved(),
                       World(rank=0, size=8, sequence_parallel=True, distributed=True))


def test_each_rank_takes_its_part_of_the_batch():
    positions = torch.arange(11)
    for n, p in [(11, 2), (7, 3), (4, 4)]:
        for r, expected in enumerate(torch.tensor_split(torch.arange(n), p)):
            got = World(r, p, sequence_parallel=True, distributed=True).sequence_slice(n)
            assert torch.equal(positions[:n][got], expected)
    x, y = torch.arange(22).view(2, 11), -torch.arange(22).view(2, 11)
    xs, ys, offset = World(1, 2, sequence_parallel=True, distributed=True).batch_part(x, y)
    assert torch.equal(xs, x[:, 6:]) and torch.equal(ys, y[:, 6:]) and offset == 6
    xs, ys, offset = World(1, 2, distributed=True).batch_part(x, y)
    assert torch.equal(xs, x[1:]) and torch.equal(ys, y[1:]) and offset == 0


def test_split_layers_keep_their_parameters_and_state():
    model = DecoderLM(12, 16, 2, 2, "performer", max_len=11, seed=0, num_features=8)
    before, parameters = model.state_dict(), list(model.parameters())
    split_sequences(model, 11)
    assert all(block.self_attn.sequence_parallel is not None for block in model.blocks)
    assert list(model.parameters()) == parameters
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    refused = DecoderLM(12, 16, 2, 1, "reformer", max_len=11, seed=0)
    with pytest.raises(ValueError, match="reformer cannot be split"):
        split_sequences(refused, 11)
    assert refused.blocks[0].self_attn.sequence_parallel is None
