"""benchmarks/flex.py's FlexAttention masks reproduce the effattn patterns they are timed against.

Small N (200: the last block partial), small windows and blocks; flex runs uncompiled (its eager
form applies the mask_mod to every score), so a mask that differs from the module's pattern
shows as an output difference far above float32 rounding. The BlockMask must also cover every
allowed pair of every head, or the compiled kernel would skip some.
"""

import warnings
from pathlib import Path

import pytest
import torch
from conftest import load_script

import effattn

flex = pytest.importorskip("torch.nn.attention.flex_attention")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "flex.py"
N, HEADS, HEAD_DIM = 200, 4, 16


def _script():
    return load_script(SCRIPT, "flex_benchmark")


bench = _script()

CASES = [
    ("local", {"window": 16}, False),
    ("local", {"window": 16}, True),
    ("local", {"window": 15, "dilation": 3}, False),
    ("local", {"window": 16, "dilation": 2}, True),
    ("longformer", {"window": 16}, False),
    ("longformer", {"window": 16, "global_tokens": (3, 77, 199)}, False),
    ("bigbird", {"block_size": 16}, False),
    ("bigbird", {"block_size": 16, "num_global_blocks": 2, "num_random_blocks": 2}, False),
]


@pytest.mark.parametrize(("method", "options", "causal"), CASES)
def test_flex_mask_reproduces_the_pattern(method, options, causal):
    module = effattn.build(method, head_dim=HEAD_DIM, heads=HEADS, seed=3, **options).eval()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, N, HEAD_DIM, generator=gen) for _ in range(3))
    mask = bench.flex_mask(method, module, N, causal, torch.device("cpu"))
    blocks = bench.block_mask(mask, N, 16, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager form warns that it is not compiled
        out = flex.flex_attention(q, k, v, block_mask=blocks)
    torch.testing.assert_close(out, module(q, k, v, causal=causal), atol=1e-5, rtol=0)
    # Every allowed (query, key) pair of every head lies in a block the BlockMask keeps.
    dense = flex.create_mask(mask.mask_mod, None, HEADS if mask.heads else None, N, N)
    kept = blocks.to_dense().repeat_interleave(16, -2).repeat_interleave(16, -1)[..., :N, :N]
    assert not (dense & ~kept.bool()).any()


def test_bigbird_table_is_the_modules_draw():
    # Per head: the random blocks differ between heads, and the table holds each head's draw.
    module = effattn.build("bigbird", head_dim=HEAD_DIM, heads=HEADS, seed=3, block_size=16).eval()
    table = bench.bigbird_block_table(module, N)
    drawn = module.random_blocks(table.shape[1])
    assert not torch.equal(table[0], table[1])
    for h in range(HEADS):
        for a in range(table.shape[1]):
            assert table[h, a, drawn[h, a][drawn[h, a] >= 0]].all()


def test_bad_arguments_exit_2(capsys):
    for argv in (["--lengths", "0"], ["--methods", "nope"], ["--dtype", "float64"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse(argv)
        assert exit_info.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err
