"""Associative recall and copying: the synthetic tasks where linear attention is known to struggle.

Both are causal language-modelling tasks: ``inputs`` (B, L) and ``targets`` (B, L), where
``targets[b, i]`` is the token the model must predict after reading ``inputs[b, : i + 1]``, and
``IGNORE`` (-100, ``cross_entropy``'s ignore_index) marks positions that are not scored.

- Multi-query associative recall (Arora et al. 2023, "Zoology"): ``k1 v1 k2 v2 ... kP vP`` with
  distinct keys, then queries ``q1 a1 q2 a2 ...`` where each q is one of the keys and a its value;
  the model is scored on predicting a after q. A fixed-size recurrent state must store P pairs.
- Copy: ``x1 ... xL SEP x1 ... xL``; scored on every token of the second half.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE = -100


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
