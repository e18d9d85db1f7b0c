"""Every example in examples/ runs at its smallest size, as a user would start it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 600  # seconds: generous, for a busy machine; each takes seconds on a quiet one


def run(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_swap_torch():
    out = run(str(EXAMPLES / "swap_torch.py"), "--small", "--threads", "1")
    assert "attention layers now hedgehog with window=16" in out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first


def test_convert_hf_llama():
    pytest.importorskip("transformers")
    out = run(str(EXAMPLES / "convert_hf_llama.py"), "--small", "--threads", "1")
    assert "effattn-hedgehog" in out and "after 10 transfer steps" in out
    assert "generated 32 tokens" in out


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="needs torch.distributed with the gloo backend")
def test_long_context_parallel_on_two_processes_equals_one():
    script = str(EXAMPLES / "long_context_parallel.py")
    two = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
              "--small")
    one = run(script, "--small")
    assert "2 process(es), sequence" in two and "1 process(es), single" in one
    losses = [[float(x) for x in re.findall(r"loss ([\d.]+)", out)] for out in (two, one)]
    assert len(losses[0]) == len(losses[1]) > 1
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_custom_method_runs_and_is_the_documented_example():
    out = run(str(EXAMPLES / "custom_method.py"), "--length", "32")
    assert "registered: True" in out and "causal is refused" in out
    difference = float(re.search(r"dense reference ([\d.e+-]+)", out).group(1))
    assert difference < 1e-10
    doc = (ROOT / "docs" / "architecture.md").read_text()
    example = doc.split("## Adding a method", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert example in (EXAMPLES / "custom_method.py").read_text(), (
        "examples/custom_method.py no longer holds docs/architecture.md's example verbatim")
