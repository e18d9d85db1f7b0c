"""Associative recall, copying and reversal: generated tasks with labels known by construction.

Recall and copy, the tasks where linear attention is known to struggle, are causal
language-modelling tasks: ``inputs`` (B, L) and ``targets`` (B, L), where ``targets[b, i]`` is the
token the model must predict after reading ``inputs[b, : i + 1]``, and ``IGNORE`` (-100,
``cross_entropy``'s ignore_index) marks positions that are not scored. Reversal is a transduction
task for an encoder-decoder: a source string and the target string that must be decoded from it.

- Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): ``k1 v1 k2 v2 ... kP vP``
  with distinct keys and distinct values drawn from disjoint halves of the vocabulary, then every
  key once more as a query at random places of the rest of the sequence (padding between); the
  model is scored on predicting the key's value at the query, and only there. A fixed-size recurrent
  state must store P pairs (:func:`mqar`, task ``recall``).
- The earlier, smaller recall (task ``recall-small``, :func:`associative_recall`): keys from
  ``vocab`` symbols, values drawn with replacement from another ``vocab``, the queries right
  after the pairs; kept for the results measured with it.
- Copy: ``x1 ... xL SEP x1 ... xL``; scored on every token of the second half.
- Reverse: source ``x1 ... xn``, target ``xn ... x1 EOS``; the decoder starts from BOS.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE = -100


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mqar(
    count: int,
    *,
    seed: int,
    seq_len: int,
    num_pairs: int | None = None,
    vocab: int = 256,
) -> tuple[Tensor, Tensor]:
    """``count`` multi-query associative recall sequences of length ``seq_len``, deterministic in
    ``seed`` (after Zoology's MQAR).

    Token ids (vocabulary ``vocab``): 0 padding, keys 1 .. vocab//2 - 1, values
    vocab//2 .. vocab - 1. Each sequence starts with ``num_pairs`` pairs ``k v`` (distinct keys,
    distinct values); the remaining ``seq_len - 2 P`` positions hold (seq_len - 2 P) // 2 slots
    of two tokens, of which P, chosen uniformly, hold a query ``k 0`` of one key each, in random
    order; everything else is padding (0). ``targets`` is the key's value at each query and
    ``IGNORE`` everywhere else. As in Zoology, the answers are not inputs: with them, a model
    could guess among the values not yet given (a third right at 8 pairs) without recalling
    anything. ``num_pairs`` defaults to min(8, seq_len // 4).
    """
    pairs = min(8, seq_len // 4) if num_pairs is None else num_pairs
    slots = (seq_len - 2 * pairs) // 2
    if pairs < 1 or slots < pairs:
        raise ValueError(f"seq_len={seq_len} leaves no room for {pairs} pairs and their queries "
                         f"(need seq_len >= 4 * num_pairs)")
    half = vocab // 2
    if pairs > half - 1:
        raise ValueError(f"num_pairs={pairs} distinct keys need vocab >= {2 * pairs + 2}, "
                         f"got {vocab}")
    g = _generator(seed)
    keys = torch.rand(count, half - 1, generator=g).argsort(-1)[:, :pairs] + 1
    values = torch.rand(count, vocab - half, generator=g).argsort(-1)[:, :pairs] + half
    which = torch.rand(count, pairs, generator=g).argsort(-1)  # query j asks for pair which[j]
    where = torch.rand(count, slots, generator=g).argsort(-1)[:, :pairs].sort(-1).values
    inputs = torch.zeros(count, seq_len, dtype=torch.long)
    targets = torch.full((count, seq_len), IGNORE, dtype=torch.long)
    inputs[:, 0 : 2 * pairs : 2] = keys
    inputs[:, 1 : 2 * pairs : 2] = values
    q_pos = 2 * pairs + 2 * where
    asked, answer = keys.gather(1, which), values.gather(1, which)
    inputs.scatter_(1, q_pos, asked)
    targets.scatter_(1, q_pos, answer)
    return inputs, targets


def associative_recall(
    count: int,
    *,
    seed: int,
    seq_len: int,
    num_pairs: int | None = None,
    vocab: int = 64,
) -> tuple[Tensor, Tensor]:
    """``count`` recall sequences of length ``seq_len``, deterministic in ``seed``.

    Token ids: 0 padding, keys 1..vocab, values vocab+1..2 vocab (vocabulary 2 vocab + 1).
    ``num_pairs`` defaults to seq_len // 4; the queries fill the rest (at most one per key).
    """
    pairs = seq_len // 4 if num_pairs is None else num_pairs
    queries = min(pairs, (seq_len - 2 * pairs) // 2)
    if pairs < 1 or queries < 1:
        raise ValueError(f"seq_len={seq_len} leaves no room for pairs and queries "
                         f"(num_pairs={num_pairs})")
    if pairs > vocab:
        raise ValueError(f"num_pairs={pairs} distinct keys need vocab >= {pairs}, got {vocab}")
    g = _generator(seed)
    keys = torch.rand(count, vocab, generator=g).argsort(-1)[:, :pairs] + 1
    values = torch.randint(vocab + 1, 2 * vocab + 1, (count, pairs), generator=g)
    which = torch.rand(count, pairs, generator=g).argsort(-1)[:, :queries]
    inputs = torch.zeros(count, seq_len, dtype=torch.long)
    targets = torch.full((count, seq_len), IGNORE, dtype=torch.long)
    inputs[:, 0 : 2 * pairs : 2] = keys
    inputs[:, 1 : 2 * pairs : 2] = values
    q_pos = torch.arange(2 * pairs, 2 * pairs + 2 * queries, 2)
    inputs[:, q_pos] = keys.gather(1, which)
    inputs[:, q_pos + 1] = values.gather(1, which)
    targets[:, q_pos] = values.gather(1, which)
    return inputs, targets


def copy_task(
    count: int, *, seed: int, seq_len: int, vocab: int = 16
) -> tuple[Tensor, Tensor]:
    """``count`` copy sequences ``x SEP x`` of length ``seq_len``, deterministic in ``seed``.

    Token ids: 0 padding, 1 SEP, symbols 2..vocab+1; L = (seq_len - 1) // 2 symbols are copied.
    """
    length = (seq_len - 1) // 2
    if length < 1:
        raise ValueError(f"seq_len={seq_len} is too short to copy anything (need >= 3)")
    g = _generator(seed)
    x = torch.randint(2, vocab + 2, (count, length), generator=g)
    inputs = torch.zeros(count, seq_len, dtype=torch.long)
    targets = torch.full((count, seq_len), IGNORE, dtype=torch.long)
    inputs[:, :length] = x
    inputs[:, length] = 1
    inputs[:, length + 1 : 2 * length + 1] = x
    targets[:, length : 2 * length] = x
    return inputs, targets


# Token ids of the reversal task (source and target share the vocabulary).
PAD, BOS, EOS = 0, 1, 2
SPECIALS = 3


def reverse_task(
    count: int, *, seed: int, min_len: int, max_len: int, digits: int = 10
) -> tuple[Tensor, Tensor]:
    """``count`` strings to reverse, of lengths uniform in [min_len, max_len], deterministic in
    ``seed``: (sources (count, max_len), targets (count, max_len + 1)).

    Token ids: 0 PAD, 1 BOS, 2 EOS, symbols 3..digits+2 (vocabulary digits + 3). A source is
    ``x1 ... xn`` padded at the end; its target is ``xn ... x1 EOS``, then ``IGNORE``.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if digits < 2:
        raise ValueError(f"digits must be >= 2, got {digits}")
    g = _generator(seed)
    lengths = torch.randint(min_len, max_len + 1, (count, 1), generator=g)
    symbols = torch.randint(SPECIALS, SPECIALS + digits, (count, max_len), generator=g)
    pos = torch.arange(max_len + 1)
    sources = symbols.masked_fill(pos[:max_len] >= lengths, PAD)
    # Position i of the target holds source position n - 1 - i; i == n is EOS.
    back = (lengths - 1 - pos).clamp(0, max_len - 1)
    targets = sources.gather(1, back)
    targets = targets.masked_fill(pos == lengths, EOS).masked_fill(pos > lengths, IGNORE)
    return sources, targets
