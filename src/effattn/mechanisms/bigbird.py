"""BigBird block-sparse attention: window, global and random blocks (Zaheer et al. 2020, ITC).

The sequence is cut into blocks of ``block_size`` (the last one padded internally, masked, and
the output trimmed). Query block a attends to key block b when
- ``|a - b| <= 1`` (the three window blocks),
- a or b is one of the first ``num_global_blocks`` blocks (global blocks attend to everything and
  everything attends to them), or
- b is one of the ``num_random_blocks`` random blocks of a, drawn per head and per query block,
  without replacement, among the blocks not already covered (fewer when fewer remain).

Random blocks come from the module's random state (:class:`effattn.random.RandomizedAttention`,
saved with the state_dict): in eval mode they are a fixed function of (seed, number of blocks);
in training mode the module generator draws new ones on every call (the sequence of draws is
fixed by the seed). ``seed=None`` draws the seed from the global RNG at construction, so an
eval-mode module still uses the same blocks on every call.

Computed by gathering each query block's window and random key blocks
(:func:`effattn.sparse.block_gather_attention`), with the global blocks' positions as the engine's
global tokens (dense rows for the global queries, one more key piece for every query, merged in
place): O(N (3 + g + r) block_size D) time, O(N D) memory kept for the backward.
q, k: (B, H, N, D), v: (B, H, N, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

import torch
from torch import Tensor

from effattn.base import check_positive_int
from effattn.random import RandomizedAttention, RandomSource, uniform
from effattn.registry import Budget, MethodSpec, register
from effattn.sparse import block_gather_attention, engine_dtype


def check_count(name: str, value: object) -> int:
    """``value`` as an int >= 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def draw_random_blocks(
    num_blocks: int,
    heads: int,
    num_random: int,
    num_global: int,
    generator: RandomSource,
) -> Tensor:
    """Random key blocks, long (heads, num_blocks, num_random), -1 in unused slots.

    Row (h, a) holds distinct blocks outside a's window {a-1, a, a+1} and the global blocks
    {0 .. num_global - 1}, uniform among the subsets of that size (Floyd's sampling: one draw per
    slot, O(heads num_blocks num_random)); when fewer than num_random blocks remain, all of them.
    """
    nb, r = num_blocks, num_random
    a = torch.arange(nb)
    window = torch.stack([a - 1, a, a + 1], 1)
    window = window.masked_fill((window < 0) | (window >= nb) | (window < num_global), nb)
    globals_ = torch.arange(min(num_global, nb)).expand(nb, -1)
    excluded = torch.cat([globals_, window], 1).sort(1).values
    available = nb - (excluded < nb).sum(1)
    chosen = torch.full((heads, nb, r), -1, dtype=torch.long)
    for slot in range(r):
        top = available - r + slot
        u = (uniform(generator, heads, nb) * (top + 1)).long()
        u = torch.minimum(u, top)
        taken = (chosen[:, :, :slot] == u[..., None]).any(-1)
        chosen[:, :, slot] = torch.where(top >= 0, torch.where(taken, top, u), -1)
    # Index u among the available blocks -> block id: step over each excluded block at or below.
    for col in range(excluded.shape[1]):
        chosen = chosen + (chosen >= excluded[:, col, None]).long()
    return chosen


def bigbird_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    random_blocks: Tensor,
    num_global_blocks: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """BigBird attention with the given random blocks (H, nb, r) (see the module docstring)."""
    if causal:
        raise ValueError("bigbird_attention is bidirectional: causal=True is not supported")
    h, n = q.shape[1:3]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    nb = -(-n // block_size)
    g = min(num_global_blocks, nb)
    if random_blocks.shape[:2] != (h, nb):
        raise ValueError(
            f"random_blocks must have shape (H, nb, r) = ({h}, {nb}, r), "
            f"got {tuple(random_blocks.shape)}"
        )
    # Global rows and keys are the engine's global tokens: they are merged into the block
    # rows' output in place, with no full-size concatenation or per-piece gradient.
    # The block indices stay on the CPU, where the random blocks are drawn: the engine moves
    # them once, and the flex strategy keys its cached BlockMask by their contents without a
    # device sync.
    a = torch.arange(nb)[:, None]
    window = a + torch.arange(-1, 2)
    window = window.masked_fill((window < g) | (window >= nb), -1)
    key_blocks = torch.cat([window.expand(h, -1, -1), random_blocks.cpu()], 2)
    # Global query blocks take their dense rows from the global piece alone.
    key_blocks[:, :g] = -1
    tokens = torch.arange(min(g * block_size, n)) if g > 0 else None
    out, _ = block_gather_attention(
        q, k, v, key_blocks, block_size=block_size, scale=scale, key_mask=key_padding_mask,
        global_tokens=tokens,
    )
    return out


class BigBirdAttention(RandomizedAttention):
    """Block window + global blocks + seeded random blocks; bidirectional."""

    def __init__(
        self, head_dim, heads, max_len=None, seed=None, scale=None, *,
        block_size, num_random_blocks, num_global_blocks,
    ):
        super().__init__(head_dim, heads, max_len=max_len, seed=seed, scale=scale)
        self.block_size = check_positive_int("block_size", block_size)
        self.num_random_blocks = check_count("num_random_blocks", num_random_blocks)
        self.num_global_blocks = check_count("num_global_blocks", num_global_blocks)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, block_size={self.block_size}, "
            f"num_random_blocks={self.num_random_blocks}, "
            f"num_global_blocks={self.num_global_blocks}"
        )

    def random_blocks(self, num_blocks: int) -> Tensor:
        """The random blocks used in eval mode for ``num_blocks`` blocks: (H, nb, r), fixed."""
        return self._draw(num_blocks, self._eval_generator())

    def _draw(self, num_blocks: int, generator: RandomSource) -> Tensor:
        return draw_random_blocks(
            num_blocks, self.heads, self.num_random_blocks, self.num_global_blocks, generator
        )

    def _attend(self, q, k, v, *, causal, key_padding_mask):
        nb = -(-q.shape[2] // self.block_size)
        blocks = self._draw(nb, self._call_generator())
        dtype = engine_dtype(q.dtype, q.device)
        return bigbird_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), block_size=self.block_size,
            random_blocks=blocks, num_global_blocks=self.num_global_blocks,
            key_padding_mask=key_padding_mask, scale=self.scale,
        )


def _reference(
    module: BigBirdAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Masked softmax over the explicit N x N block pattern, with the module's eval-mode random
    blocks."""
    from effattn import naive  # imported here: the references stay off the runtime path

    nb = -(-q.shape[2] // module.block_size)
    return naive.bigbird_attention(
        q, k, v, block_size=module.block_size, random_blocks=module.random_blocks(nb),
        num_global_blocks=module.num_global_blocks, key_padding_mask=key_padding_mask,
        scale=module.scale,
    )


register(
    MethodSpec(
        name="bigbird",
        summary="block-sparse: 3 window blocks, global blocks and seeded random blocks",
        paper="Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences",
        complexity="O(N (3 + g + r) block_size D) time, O(N D) memory",
        causal=False,
        padding_mask=True,
        cross=False,
        decoding=False,
        options={"block_size": 64, "num_random_blocks": 3, "num_global_blocks": 1},
        budget=Budget("block_size", (8, 16, 32, 64)),
        published={"lra_listops": 36.05},
        refusals={
            "causal": "global blocks attend to and are attended by every block, and random "
            "blocks point anywhere: the pattern is bidirectional by design",
            "cross": "window and global blocks are defined over aligned query and key "
            "positions (N == M)",
            "decoding": "global blocks attend to the whole sequence, future included, so there "
            "is no causal recurrence",
            "sequence_parallel": "global blocks attend to and are attended by every block, and "
            "random blocks point anywhere in the sequence",
        },
        reference=_reference,
    ),
    BigBirdAttention,
)
