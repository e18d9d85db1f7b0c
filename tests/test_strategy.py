"""The one place that picks an engine's strategy: defaults by device, and both overrides."""

import os
import subprocess
import sys

import pytest
import torch

from effattn import strategy


def test_defaults_follow_the_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(strategy, "_forced", {})  # the defaults, whatever EFFATTN_STRATEGY says
    assert strategy.choose("kernelized", cpu) == "cpu"
    assert strategy.choose("banded", cpu) == "cpu"
    assert strategy.choose("kernelized", cuda) == "gpu"
    assert strategy.choose("banded", cuda) == "flex"


def test_force_applies_on_every_device_and_is_undone():
    before = strategy.forced()
    with strategy.force(kernelized="gpu"):
        assert strategy.choose("kernelized", torch.device("cpu")) == "gpu"
        with strategy.force(kernelized="cpu"):
            assert strategy.choose("kernelized", torch.device("cuda")) == "cpu"
        assert strategy.choose("kernelized", torch.device("cpu")) == "gpu"
    assert strategy.forced() == before


@pytest.mark.parametrize("kwargs, match", [
    ({"kernelized": "tpu"}, "unknown strategy 'tpu'"),
    ({"dense": "cpu"}, "unknown engine 'dense'"),
])
def test_force_rejects_unknown_names(kwargs, match):
    with pytest.raises(ValueError, match=match), strategy.force(**kwargs):
        pass


def test_parse():
    assert strategy.parse(" kernelized=gpu , banded=flex,") == {
        "kernelized": "gpu", "banded": "flex"}
    assert strategy.parse("") == {}
    for bad, match in [("kernelized", "not engine=strategy"), ("banded=gpu", "EFFATTN_STRATEGY"),
                       ("x=cpu", "unknown engine")]:
        with pytest.raises(ValueError, match=match):
            strategy.parse(bad)


def test_environment_is_read_at_import():
    code = ("import torch; from effattn import strategy; "
            "print(strategy.choose('kernelized', torch.device('cpu')))")
    env = {"EFFATTN_STRATEGY": "kernelized=gpu", "PATH": "/usr/bin:/bin"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "gpu"
