"""The FlexAttention strategy of the banded engine (``strategy.choose("banded", ...) == "flex"``).

FlexAttention (PyTorch, ``torch.nn.attention.flex_attention``; Dong et al. 2024, "Flex
Attention: A Programming Model for Generating Optimized Attention Kernels") computes

    out_i = sum_j p_ij v_j,  p_ij = exp(s_ij - lse_i),  lse_i = log sum_{j allowed} exp(s_ij),

with s_ij = score_mod(scale q_i.k_j, b, h, i, j) over the pairs a ``mask_mod`` allows, and a
BlockMask that lists, per query block, the key blocks holding any allowed pair (those holding
only allowed pairs as "full", where the mask_mod is not evaluated). The compiled kernel skips
every other block, which makes it the GPU form of the CPU engine's pieces:

- the pattern: the union of the pieces' rules (:meth:`effattn.sparse.pieces.Band.rule` and
  siblings: the one definition the CPU engine and the tests use) is the ``mask_mod``; Globals
  are one more term of the union (``or_masks``, written out); the CPU engine's rule that
  pieces be disjoint is its own bookkeeping and does not apply;
- the BlockMask comes from the same rule, evaluated densely over slices of query blocks on the
  device (no N x N tensor; no compiled ``create_block_mask``, whose compilation took minutes
  for BigBird's per-head mask), and is cached per (pattern, N, M, device): built once, reused;
- key padding and the soft cap are a ``score_mod``: ``-inf`` where ``key_mask[b, j]`` (so the
  cached BlockMask stays valid for every batch), ``c tanh(s / c)`` with a soft cap (Gemma 2);
- FlexAttention returns lse in natural log, and on a row with no allowed key out = 0 and
  lse = -inf (its kernel sets the row's normaliser to 1 there), the contract of
  :func:`effattn.sparse.sparse_attention` that the window hybrid's merge and softmax's sinks
  rely on; tests/test_flex_strategy.py checks it.

On CUDA the kernel is ``torch.compile(flex_attention, dynamic=False)``: one compilation per shape
(and per pattern kind), whose first-call time is kept in :data:`COMPILE_SECONDS` for the
benchmarks. On the CPU, torch (2.13) has no FlexAttention backward and its compiled CPU form
returns no lse, so the strategy runs FlexAttention's unfused eager form, for inference only
(no input requiring a gradient): slow, but the same code path, so that a forced
``EFFATTN_STRATEGY=banded=flex`` can be tested on the CPU.

Inside an outer ``torch.compile`` (a compiled model, ``fullgraph=True`` included) the strategy
runs too. The cache lookup, which hashes the pattern's tensors, is the ``effattn::flex_block_mask``
operator: dynamo traces it as one opaque node, which at every call returns copies of the cached
BlockMask's block lists and of the pieces' tables (built on the first call, as outside), and the
BlockMask and its mask_mod are made around them in the graph. flex_attention itself is traced
into the outer graph, which the caller's backend compiles (no kernel of our own; nothing is
timed). On the CPU there inductor's kernel returns no lse, so out and lse come from two calls,
the second dropped from the graph where the caller drops the lse: a caller that uses it
(softmax's sinks, the window hybrid) compiles with an eager backend such as ``aot_eager`` only.
That kernel also needs every tensor the mask_mod and score_mod read to be a buffer of its own,
not one computed in the graph: hence the tables from the operator, and the padding mask
copied by the opaque ``effattn::flex_copy``.

Shapes: q, k (B, H, N, D), v (B, H, N, Dv); key_mask bool (B, N), True = ignore; returns
out (B, H, N, Dv) in q's dtype and lse (B, H, N) (fp32 for half-precision inputs). Head dims
under 16, which the compiled kernel refuses, are widened with zero columns (exact: they add
nothing to q.k, and the output's are cut off).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import fields

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9 returns the log-sum-exp by return_lse=True
    AuxRequest = None

from effattn.base import read_deferred_values
from effattn.sparse.pieces import Band, Blocks, Columns, Globals, Piece, Rule, Summary, union

# FlexAttention's default BlockMask block: its kernels' tiles divide it.
BLOCK_SIZE = 128
# BlockMasks kept (least recently used dropped): a training-mode BigBird draws a new pattern
# per call, which must not grow the cache without bound.
CACHE_SIZE = 32
# Scores the BlockMask builder evaluates per slice of query blocks (bool temporaries of this
# many elements, a few times over).
SLICE_ELEMENTS = 1 << 26
# The smallest head dim (of q and k, and of v) FlexAttention's compiled kernel takes (torch
# 2.11, CUDA: "NYI: embedding dimension of the query, key, and value must be at least 16").
MIN_HEAD_DIM = 16
# Dynamo's default of 8 compilations per function would be spent by a handful of
# (shape, pattern kind) pairs, after which flex_attention silently runs unfused.
RECOMPILE_LIMIT = 64

# FlexAttention's tiles where its defaults need more shared memory than the GPU has (torch's
# kernel_options; the BlockMask's 128 is a multiple of each). Seen on an H200 (2026-11-28):
# bigbird at N = 16384 in bf16 needed 311296 bytes of its 232448; a forward with 64 x 64 tiles
# and one stage holds about a quarter of what 128 x 128 tiles with several stages hold.
SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1,
               "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
# The shapes (COMPILE_SECONDS' keys) compiled with SMALL_TILES after the default ones failed.
SMALL_TILE_SHAPES: set[str] = set()

COMPILE_SECONDS: dict[str, float] = {}
"""Seconds of the first call of each compiled shape (compilation included), by a key naming
the shape, dtype, pattern kinds and score_mod: what the benchmarks report as compile time."""

# (pattern, mask heads, N, M, device) -> the BlockMask and the pieces' tables its mask_mod reads.
_block_masks: OrderedDict[tuple, tuple[BlockMask, tuple[tuple[Tensor, ...], ...]]] = (
    OrderedDict())
_PIECE_TYPES = {kind.__name__: kind for kind in (Band, Blocks, Columns, Summary, Globals)}
_compiled: Callable[..., tuple[Tensor, object]] | None = None


def _fingerprint(value: object) -> object:
    """A hashable stand-in for a piece's field: tensors by their contents (they are small:
    tokens, key blocks, patterns), other values as they are."""
    if isinstance(value, Tensor):
        data = value.detach().cpu().contiguous()
        return (tuple(data.shape), str(data.dtype),
                hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest())
    return value


def pattern_key(pieces: Sequence[Piece]) -> tuple:
    """The pattern of ``pieces`` as a hashable key (the cache's)."""
    return tuple((type(piece).__name__,
                  tuple(_fingerprint(getattr(piece, f.name)) for f in fields(piece)))
                 for piece in pieces)


def mask_heads(pieces: Sequence[Piece], heads: int) -> int:
    """Heads of the pattern's BlockMask: H when some piece differs by head (BigBird's random
    blocks), else 1 (broadcast over the heads)."""
    per_head = any(isinstance(piece, Blocks) and piece.key_blocks is not None
                   and piece.key_blocks.dim() == 3 and piece.key_blocks.shape[0] > 1
                   for piece in pieces)
    return heads if per_head else 1


def build_block_mask(rule: Rule, heads: int, n: int, device: torch.device,
                     block_size: int = BLOCK_SIZE) -> BlockMask:
    """The BlockMask of ``rule`` over N x N aligned positions and ``heads`` heads (1: shared).

    Evaluates the rule densely over slices of query blocks (about SLICE_ELEMENTS pairs each)
    and reduces every (query block, key block) tile to empty, partial or full, listed per query
    block (the kv side) and per key block (the q side); the rule is also the BlockMask's
    mask_mod, applied to the partial tiles. Positions past N (the last tile of a length that is
    no multiple of the block) count as disallowed, so such tiles are partial and FlexAttention's
    own bounds check applies there.
    """
    nb = -(-n // block_size)
    padded = nb * block_size
    per_block = heads * block_size * padded
    step = max(1, SLICE_ELEMENTS // per_block)
    h = torch.arange(heads, device=device)[:, None, None]
    j = torch.arange(n, device=device)[None, None, :]
    any_parts, all_parts = [], []
    for a0 in range(0, nb, step):
        a1 = min(nb, a0 + step)
        i = torch.arange(a0 * block_size, min(a1 * block_size, n), device=device)
        ok = torch.zeros(heads, (a1 - a0) * block_size, padded, dtype=torch.bool, device=device)
        ok[:, : i.numel(), :n] = rule(h, i[None, :, None], j)
        tiles = ok.view(heads, a1 - a0, block_size, nb, block_size)
        any_parts.append(tiles.any(4).any(2))
        all_parts.append(tiles.all(4).all(2))
    touched, full = torch.cat(any_parts, 1), torch.cat(all_parts, 1)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return rule(h, q_idx, kv_idx)

    return tile_block_mask(touched & ~full, full, (n, n), mask_mod, block_size)


def tile_block_mask(partial: Tensor, full: Tensor, seq_lengths: tuple[int, int],
                    mask_mod: Callable[..., Tensor], block_size: int = BLOCK_SIZE) -> BlockMask:
    """The BlockMask of tiles classed partial (the mask_mod runs there) or full (it does not),
    bool (H', query blocks, key blocks) each, over ``seq_lengths`` (N, M) positions: the blocks
    listed per query block (the kv side) and per key block (the q side, the backward's)."""

    def listing(blocks: Tensor) -> tuple[Tensor, Tensor]:
        # Listed blocks first, in order: a stable sort of "not listed".
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
        return (blocks.sum(-1, dtype=torch.int32)[None],
                order.to(torch.int32, memory_format=torch.contiguous_format)[None])

    # The q side lists the transposed tiles; BlockMask.from_kv_blocks would rebuild the tiles
    # from the lists by vmap, which fails inside the block-mask operator under aot_eager
    # ("Cannot access storage of BatchedTensorImpl").
    return BlockMask(seq_lengths, *listing(partial), *listing(full),
                     *listing(partial.transpose(1, 2)), *listing(full.transpose(1, 2)),
                     BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod)


def _cached(pieces: Sequence[Piece], heads: int, n: int,
            device: torch.device) -> tuple[BlockMask, tuple[tuple[Tensor, ...], ...]]:
    """The cached BlockMask of the union of ``pieces`` and the pieces' tables its mask_mod reads
    (:meth:`effattn.sparse.pieces.Blocks.tables`), built on the first call for that
    (pattern, N, M, device), then reused."""
    h = mask_heads(pieces, heads)
    key = (pattern_key(pieces), h, n, n, str(device))
    found = _block_masks.get(key)
    if found is not None:
        _block_masks.move_to_end(key)
        return found
    tables = tuple(piece.tables(n, device) for piece in pieces)
    made = build_block_mask(union(pieces, n, device, tables), h, n, device), tables
    _block_masks[key] = made
    while len(_block_masks) > CACHE_SIZE:
        _block_masks.popitem(last=False)
    return made


def block_mask(pieces: Sequence[Piece], heads: int, n: int, device: torch.device) -> BlockMask:
    """The cached BlockMask of the union of ``pieces`` for ``heads`` heads, N = M = ``n`` on
    ``device``: built on the first call for that (pattern, N, M, device), then reused."""
    return _cached(pieces, heads, n, device)[0]


def _describe(pieces: Sequence[Piece]) -> tuple[str, list[Tensor], list[int], list[int]]:
    """``pieces`` as the block-mask operator's arguments: a spec naming each piece's type and
    fields ("Band:I,I,I,None;Globals:T": T a tensor, I an int, None and bools as they are), the
    tensors and the ints in order (an int may be symbolic under dynamic shapes: a stride
    derived from N), and how many tensors each piece holds (as many as it has tables). Plain
    Python over the pieces' fields, which dynamo folds while it traces."""
    parts, tensors, ints, counts = [], [], [], []
    for piece in pieces:
        codes = []
        held = len(tensors)
        for field in fields(piece):
            value = getattr(piece, field.name)
            if isinstance(value, Tensor):
                tensors.append(value)
                codes.append("T")
            elif value is None or isinstance(value, bool):
                codes.append(str(value))
            else:
                ints.append(value)
                codes.append("I")
        parts.append(f"{type(piece).__name__}:{','.join(codes)}")
        counts.append(len(tensors) - held)
    return ";".join(parts), tensors, ints, counts


def _pieces(spec: str, tensors: Sequence[Tensor], ints: Sequence[int]) -> list[Piece]:
    """The pieces :func:`_describe` described."""
    values = {"T": iter(tensors), "I": iter(ints)}
    constants = {"None": None, "True": True, "False": False}
    made = []
    for part in spec.split(";"):
        name, codes = part.split(":")
        made.append(_PIECE_TYPES[name](*(
            next(values[code]) if code in values else constants[code]
            for code in codes.split(","))))
    return made


def mask_tensors(mask: BlockMask) -> list[Tensor]:
    """The BlockMask's block lists, in its constructor's order."""
    return [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
            mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices]


# A CUDA graph replays kernels, not this operator: it would keep the copies of the first call's
# BlockMask (stale once the pattern changes, or once the cache drops it). The tag keeps
# inductor's CUDA graphs off the operator; torch versions without it have no such check.
_CUDA_GRAPH_UNSAFE = ({"tags": (torch.Tag.cudagraph_unsafe,)}
                      if hasattr(torch.Tag, "cudagraph_unsafe") else {})


@torch.library.custom_op("effattn::flex_block_mask", mutates_args=(), **_CUDA_GRAPH_UNSAFE)
def _block_mask_op(spec: str, tensors: list[Tensor], ints: list[int], heads: int, n: int,
                   device: torch.device) -> list[Tensor]:
    """The cached BlockMask of the pieces ``spec``, ``tensors`` and ``ints`` describe
    (:func:`_describe`) as its eight tensors (kv_num_blocks (1, H', nb), kv_indices
    (1, H', nb, nb), the full blocks', then the q side's; H' = :func:`mask_heads`,
    nb = ceil(N / BLOCK_SIZE)), followed by the pieces' tables.

    An operator because dynamo cannot trace the cache (the pattern's tensors hashed by their
    contents, a dict): inside an outer torch.compile it is one opaque node, run at every call,
    that builds the BlockMask once per pattern and returns the cached one after.
    """
    mask, tables = _cached(_pieces(spec, tensors, ints), heads, n, device)
    # Copies: a compiled graph owns an operator's outputs (inductor may reuse their memory for
    # later buffers), and these are the cache's.
    return [x.clone() for x in [*mask_tensors(mask), *(x for found in tables for x in found)]]


@_block_mask_op.register_fake
def _(spec: str, tensors: list[Tensor], ints: list[int], heads: int, n: int,
      device: torch.device) -> list[Tensor]:
    pieces = _pieces(spec, tensors, ints)
    h, nb = mask_heads(pieces, heads), -(-n // BLOCK_SIZE)
    count = torch.empty(1, h, nb, dtype=torch.int32, device=device)
    index = torch.empty(1, h, nb, nb, dtype=torch.int32, device=device)
    tables = [x for piece in pieces for x in piece.tables(n, device)]
    return [torch.empty_like(x) for x in [count, index] * 4 + tables]


@torch.library.custom_op("effattn::flex_copy", mutates_args=())
def _copy(x: Tensor) -> Tensor:
    """A copy of ``x`` that dynamo traces as one opaque node: a buffer of its own in the graph
    (see :func:`_traced_block_mask` for why FlexAttention's CPU kernel needs one)."""
    return x.clone()


@_copy.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _traced_block_mask(pieces: Sequence[Piece], heads: int, n: int,
                       device: torch.device) -> BlockMask:
    """:func:`block_mask` inside an outer torch.compile: the cached tensors from the operator,
    the BlockMask and its mask_mod made around them in the graph.

    The mask_mod reads the operator's copies of the tables, never tables computed in the graph:
    torch 2.13's CPU FlexAttention kernel read such buffers wrongly (outputs off by O(1) with
    global tokens) or failed to compile (NoValidChoicesError with BigBird's slot table).
    """
    spec, tensors, ints, counts = _describe(pieces)
    made = _block_mask_op(spec, tensors, ints, heads, n, device)
    found, tables = made[8:], []
    for count in counts:
        tables.append(tuple(found[:count]))
        found = found[count:]
    rule = union(pieces, n, device, tables)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return rule(h, q_idx, kv_idx)

    return BlockMask((n, n), *made[:8], BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE), mask_mod=mask_mod)


def score_mod(softcap: float | None,
              key_mask: Tensor | None) -> Callable[..., Tensor] | None:
    """The score_mod of a call: the soft cap ``c tanh(s / c)`` of the scores s = scale q.k, then
    -inf at padded keys (``key_mask`` bool (B, N), True = ignore); None when neither applies."""
    if softcap is None and key_mask is None:
        return None

    def modify(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if key_mask is not None:
            score = torch.where(key_mask[b, kv_idx], float("-inf"), score)
        return score

    return modify


def _lse_request() -> dict[str, object]:
    """flex_attention's keyword asking for the log-sum-exp (torch's spelling of the day)."""
    return {"return_lse": True} if AuxRequest is None else {"return_aux": AuxRequest(lse=True)}


def _lse(aux: object) -> Tensor:
    """The log-sum-exp of flex_attention's second output (AuxOutput, or the tensor itself)."""
    return aux if isinstance(aux, Tensor) else aux.lse


def widened(x: Tensor) -> Tensor:
    """``x`` with zero columns appended up to :data:`MIN_HEAD_DIM` (itself where it is wide
    enough): zero columns add nothing to q.k (the scale is passed, not derived from the width),
    and the output's extra columns, zero, are cut off."""
    short = MIN_HEAD_DIM - x.shape[-1]
    return x if short <= 0 else torch.nn.functional.pad(x, (0, short))


def compiled_on(device: torch.device) -> bool:
    """Whether flex_attention runs compiled on ``device`` (CUDA), else in its eager form."""
    return device.type == "cuda"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel() -> Callable[..., tuple[Tensor, object]]:
    """flex_attention compiled once (per shape, by dynamo's guards)."""
    global _compiled
    if _compiled is None:
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def refuse_gradients_off_cuda(*inputs: Tensor) -> None:
    """``NotImplementedError`` where autograd would record a call of the strategy off CUDA:
    torch has no FlexAttention backward there."""
    device = inputs[0].device
    if not compiled_on(device) and torch.is_grad_enabled() and any(
            x.requires_grad for x in inputs):
        raise NotImplementedError(
            f"the banded strategy 'flex' runs on {device.type} for inference only: torch "
            f"{torch.__version__} has no FlexAttention backward there; use the default "
            "strategy (EFFATTN_STRATEGY=banded=cpu) or run under torch.no_grad()"
        )


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pieces: Sequence[Piece],
    *,
    scale: float,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`effattn.sparse.sparse_attention` by FlexAttention (see the module docstring); the
    caller has applied the shared checks (:func:`effattn.sparse.pieces.check_pieces`)."""
    # One tensor passed twice (q as k, say) after a call with distinct ones makes dynamo's
    # recompilation report fail inside flex_attention (torch 2.13: IndexError in its tensor
    # aliasing guard's reason): distinct views of it cost nothing.
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    refuse_gradients_off_cuda(q, k, v)
    out, lse = _attend(widened(q), widened(k), widened(v), pieces, scale=scale,
                       key_mask=key_mask, softcap=softcap)
    if out.shape[-1] != v.shape[-1]:
        out = out[..., : v.shape[-1]].contiguous()
    return out, lse


def _attend(q: Tensor, k: Tensor, v: Tensor, pieces: Sequence[Piece], *, scale: float,
            key_mask: Tensor | None, softcap: float | None) -> tuple[Tensor, Tensor]:
    """:func:`sparse_attention` on head dims of at least :data:`MIN_HEAD_DIM`."""
    b, h, n, _ = q.shape
    compiling = torch.compiler.is_compiling()
    mask = (_traced_block_mask if compiling else block_mask)(pieces, h, n, q.device)
    if key_mask is not None:
        key_mask = key_mask.to(q.device)
        if compiling and not compiled_on(q.device):
            # The score_mod reads it: like the mask_mod's tables, the CPU kernel needs a buffer
            # of its own (a mask computed in the graph, keep == 0, failed to compile).
            key_mask = _copy(key_mask)
    modify = score_mod(softcap, key_mask)
    if compiling:
        request = _lse_request()
        # Traced into the outer graph, which its backend compiles (no kernel of our own).
        if compiled_on(q.device):
            out, aux = flex_attention(q, k, v, score_mod=modify, block_mask=mask, scale=scale,
                                      **request)
            return out, _lse(aux)
        # The compiled CPU kernel returns no lse: the output comes from a call without it, the
        # lse from a second call, which the graph drops where the caller drops the lse (and
        # which only an eager backend such as aot_eager can run).
        out = flex_attention(q, k, v, score_mod=modify, block_mask=mask, scale=scale)
        _, aux = flex_attention(q, k, v, score_mod=modify, block_mask=mask, scale=scale,
                                **request)
        return out, _lse(aux)
    what = (f"{'+'.join(type(p).__name__ for p in pieces)} "
            f"softcap={softcap is not None} padding={key_mask is not None}")
    return launch(q, k, v, mask, modify, scale=scale, what=what)


def launch(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask,
           modify: Callable[..., Tensor] | None, *, scale: float,
           what: str) -> tuple[Tensor, Tensor]:
    """FlexAttention of q, k (B, H, N, D), v (B, H, M, Dv) (head dims of at least
    :data:`MIN_HEAD_DIM`) under ``mask`` and the score_mod ``modify``, outside an outer
    torch.compile: out (B, H, N, Dv) and lse (B, H, N). Eager on the CPU; compiled on CUDA,
    the first call of each shape timed into :data:`COMPILE_SECONDS` under a key of the shapes,
    the dtype, ``what`` (the pattern's kinds) and whether autograd records, and compiled again
    with :data:`SMALL_TILES` where its default tiles find no kernel within the GPU's shared
    memory. The forward call's deferred value check is read right before the launch."""
    request = _lse_request()
    if not compiled_on(q.device):
        read_deferred_values()
        with warnings.catch_warnings():
            # The eager form warns that it is unfused: here it is the point.
            warnings.simplefilter("ignore", UserWarning)
            out, aux = flex_attention(q, k, v, score_mod=modify, block_mask=mask, scale=scale,
                                      **request)
        return out, _lse(aux)
    kernel = _kernel()
    key = (f"{tuple(q.shape)}x{tuple(v.shape)} {q.dtype} {what} "
           f"grad={torch.is_grad_enabled() and q.requires_grad}")
    # The value check's host sync, as late as the call allows: the preparation before it (the
    # cached BlockMask, the score_mod) then overlaps the kernels still running on the device.
    read_deferred_values()
    if key in SMALL_TILE_SHAPES:
        request["kernel_options"] = SMALL_TILES
    if key in COMPILE_SECONDS:
        out, aux = kernel(q, k, v, score_mod=modify, block_mask=mask, scale=scale, **request)
        return out, _lse(aux)
    _synchronize(q.device)
    start = time.perf_counter()
    try:
        out, aux = kernel(q, k, v, score_mod=modify, block_mask=mask, scale=scale, **request)
    except Exception as error:
        if "kernel_options" in request or not _out_of_shared_memory(error):
            raise
        warnings.warn(
            f"FlexAttention found no kernel within this GPU's shared memory for {key} with its "
            f"default tiles; compiling it with smaller ones ({SMALL_TILES})", stacklevel=2)
        SMALL_TILE_SHAPES.add(key)
        request["kernel_options"] = SMALL_TILES
        out, aux = kernel(q, k, v, score_mod=modify, block_mask=mask, scale=scale, **request)
    _synchronize(q.device)
    COMPILE_SECONDS[key] = time.perf_counter() - start
    return out, _lse(aux)


def _out_of_shared_memory(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from) is inductor's report that no kernel
    configuration fits the GPU's shared memory ("No valid triton configs. OutOfMemoryError:
    out of resource: ... Required: 311296 Hardware limit: 232448")."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if "out of resource" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
