"""Reformer's chunked attention by one FlexAttention call (the banded engine's ``flex`` strategy).

After hashing and sorting (the :class:`~effattn.sparse.lsh.Layout` of a call), round r of R cuts the
queries into chunks of C slots (``rows``: the token in each slot, -1 for none) and gives chunk c
a window of W keys (``cols``, ``col_ok``). The CPU strategy gathers each group of chunks and
multiplies (C, W) blocks in a loop; here every round's queries are gathered into their slot
order and every chunk's window into a private run of W key rows, so that in these coordinates
the pattern is block-diagonal:

    slot i (chunk i // C) meets key row j (chunk j // W) iff i // C == j // W,

which a BlockMask lists once per (C, W, lengths), and the rounds are stacked on the head axis
(H R heads, round r = head % R): one compiled kernel for all of them, in the inputs' dtype
(fp32 softmax statistics inside, as flash attention keeps them). The ``mask_mod`` applies the
rest of the pair rule of :func:`effattn.mechanisms.reformer.reformer_attention`, reading tables
of the layout gathered into the same coordinates:

- the column holds a real key (``col_ok``) and the slot a query;
- the round's own rule where it is not the window itself (causal: key code within
  [q_code, q_code + span) of round r; without shared QK also key position <= query position;
  with shared QK, not the token itself: slot u of a chunk is its window's column C + u);
- a pair candidate in an earlier round e < r is dropped (the same code test in round e), so
  that each pair counts once in the union of the rounds.

Each round returns its output and log-sum-exp per slot; gathered back to token order, the rounds
merge by their log-sum-exps into softmax attention over the union of the candidates (with the
CPU strategy's own-key term, causal without shared QK, and v for a shared-QK token with no
candidate). That is exactly the result of the CPU strategy, to rounding.

On the CPU FlexAttention runs its eager form, for inference only (as the banded strategy):
forced there (``EFFATTN_STRATEGY=banded=flex``) the tests compare it with the CPU strategy.
Inside an outer ``torch.compile`` the CPU strategy's batched path runs instead.

Shapes: B batch, H heads, N queries, M keys, D head dim, Dv value dim, R rounds, C slots per
chunk, W keys per window, S = n_chunks C slots and K = n_chunks W window rows, each padded to
a multiple of FlexAttention's block (128).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, noop_mask

from effattn.sparse import flex
from effattn.sparse.lsh import Layout

# The block-diagonal tile lists, by (S, K, C, W, device): a few per model.
_tiles: OrderedDict[tuple, list[Tensor]] = OrderedDict()
CACHE_SIZE = 16


def _padded(length: int) -> int:
    return -(-length // flex.BLOCK_SIZE) * flex.BLOCK_SIZE


def block_tiles(slots: int, rows: int, chunk: int, width: int, chunks: int,
                device: torch.device) -> list[Tensor]:
    """The BlockMask's eight block lists (its constructor's order) of the block-diagonal
    pattern: ``chunks`` chunks of ``chunk`` slots against windows of ``width`` rows, over
    ``slots`` x ``rows`` padded positions; cached, every tile partial (the mask_mod runs
    everywhere: windows hold padded columns and earlier rounds' pairs)."""
    key = (slots, rows, chunk, width, chunks, str(device))
    found = _tiles.get(key)
    if found is not None:
        _tiles.move_to_end(key)
        return found
    size = flex.BLOCK_SIZE
    first = torch.arange(0, slots, size, device=device)
    c0 = (first // chunk).clamp_max(chunks - 1)
    c1 = ((first + size - 1) // chunk).clamp_max(chunks - 1)
    low, high = c0 * width // size, ((c1 + 1) * width - 1) // size
    blocks = torch.arange(rows // size, device=device)
    touched = (blocks >= low[:, None]) & (blocks <= high[:, None]) & (first < chunks * chunk)[
        :, None]
    made = flex.tile_block_mask(touched[None], torch.zeros_like(touched)[None], (slots, rows),
                                noop_mask)
    found = flex.mask_tensors(made)
    _tiles[key] = found
    while len(_tiles) > CACHE_SIZE:
        _tiles.popitem(last=False)
    return found


def _in_rounds(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, L, ...) at index (B, H, R, S) (>= 0) per round: (B, H, R, S, ...)."""
    b, h, rounds, s = index.shape
    rest = x.shape[3:]
    source = x[:, :, None].expand(b, h, rounds, *x.shape[2:])
    at = index.view(b, h, rounds, s, *(1,) * len(rest)).expand(b, h, rounds, s, *rest)
    return source.gather(3, at)


def attend(q: Tensor, keys: Tensor, v: Tensor, layout: Layout, *, pad: Tensor, scale: float,
           causal: bool, shared_qk: bool) -> Tensor:
    """LSH attention of q (B, H, N, D) over keys (B, H, M, D) (k, or k/|k| with shared QK) and
    v (B, H, M, Dv) with the candidates of ``layout`` and the padding ``pad`` (B, M): out
    (B, H, N, Dv) in q's dtype (see the module docstring)."""
    flex.refuse_gradients_off_cuda(q, keys, v)
    b, h, n, _ = q.shape
    rounds, chunks, chunk = layout.rows.shape[2:]
    width = layout.cols.shape[-1]
    span = layout.span
    slots, rows = _padded(chunks * chunk), _padded(chunks * width)
    # Slots and window rows, padded to whole blocks: an empty slot holds no query (-1), a
    # padded row no key (col_ok False).
    row_tok = F.pad(layout.rows.flatten(-2), (0, slots - chunks * chunk), value=-1)
    col_tok = F.pad(layout.cols.flatten(-2), (0, rows - chunks * width))
    col_ok = F.pad(layout.col_ok.flatten(-2), (0, rows - chunks * width), value=False)
    q_slots = _in_rounds(q, row_tok.clamp_min(0))
    k_rows, v_rows = _in_rounds(keys, col_tok), _in_rounds(v, col_tok)
    # Every round's codes at this round's slots and rows: (B, H, R, R_e, S) and (.., K).
    q_codes = layout.q_code[:, :, None].expand(b, h, rounds, rounds, n).gather(
        4, row_tok.clamp_min(0)[:, :, :, None].expand(b, h, rounds, rounds, slots))
    k_codes = layout.k_code[:, :, None].expand(b, h, rounds, *layout.k_code.shape[2:]).gather(
        4, col_tok[:, :, :, None].expand(b, h, rounds, rounds, rows))

    def heads(x: Tensor) -> Tensor:
        return x.flatten(1, 2)  # (B, H, R, ...) -> (B, H R, ...): round r = head % R

    row_tok, col_tok, col_ok = heads(row_tok), heads(col_tok), heads(col_ok)
    q_codes, k_codes = heads(q_codes), heads(k_codes)

    def mask_mod(bi: Tensor, hs: Tensor, i: Tensor, j: Tensor) -> Tensor:
        r = hs % rounds
        keep = (i // chunk == j // width) & col_ok[bi, hs, j] & (row_tok[bi, hs, i] >= 0)
        own = None
        for e in range(rounds):
            low, code = q_codes[bi, hs, e, i], k_codes[bi, hs, e, j]
            seen = (code >= low) & (code < low + span)
            keep = keep & ~(seen & (e < r))
            if causal:
                mine = seen & (e == r)
                own = mine if own is None else own | mine
        if causal:
            keep = keep & own
            if not shared_qk:
                keep = keep & (col_tok[bi, hs, j] <= row_tok[bi, hs, i])
        if shared_qk:
            keep = keep & (i % chunk + chunk != j % width)
        return keep

    mask = BlockMask((slots, rows), *block_tiles(slots, rows, chunk, width, chunks, q.device),
                     BLOCK_SIZE=(flex.BLOCK_SIZE, flex.BLOCK_SIZE), mask_mod=mask_mod)
    what = f"reformer C={chunk} W={width} R={rounds} causal={causal} shared_qk={shared_qk}"
    out, lse = flex.launch(flex.widened(heads(q_slots)), flex.widened(heads(k_rows)),
                           flex.widened(heads(v_rows)), mask, None, scale=scale, what=what)
    # Back to token order (each query's slot in each round), merged in the dtype of the
    # log-sum-exps (fp32 for half-precision inputs).
    acc = lse.dtype
    outs = _in_rounds_back(out[..., :v.shape[-1]].unflatten(1, (h, rounds)).to(acc),
                           layout.q_slot)
    lses = lse.unflatten(1, (h, rounds)).gather(3, layout.q_slot)
    if causal and not shared_qk:
        # Key i joins the union of query i unless a round has it (see reformer_attention).
        own = scale * (q.to(acc) * keys.to(acc)).sum(-1)
        gap = layout.k_code - layout.q_code
        fresh = ~pad[:, None, :] & ((gap < 0) | (gap >= span)).all(dim=2)
        outs = torch.cat([outs, v[:, :, None].to(acc)], 2)
        lses = torch.cat([lses, own.masked_fill(~fresh, float("-inf"))[:, :, None]], 2)
    # Merged by the rounds' log-sum-exps; the shift is detached (any finite one cancels).
    best = lses.detach().amax(2, keepdim=True)
    best = torch.where(torch.isfinite(best), best, 0.0)
    weights = torch.exp(lses - best)
    total = weights.sum(2)
    result = (outs * weights[..., None]).sum(2) / torch.where(total > 0, total, 1.0)[..., None]
    if shared_qk:
        alone = (total == 0) & ~pad[:, None, :]
        result = torch.where(alone[..., None], v.to(acc), result)
    return result.to(q.dtype)


def _in_rounds_back(x: Tensor, slot: Tensor) -> Tensor:
    """x (B, H, R, S, Dv) per slot at each query's slot (B, H, R, N): (B, H, R, N, Dv)."""
    return x.gather(3, slot[..., None].expand(*slot.shape, x.shape[-1]))
