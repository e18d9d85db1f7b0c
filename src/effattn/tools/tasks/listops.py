"""ListOps (Nangia & Bowman 2018) with the Long Range Arena generator's grammar (Tay et al. 2021).

An expression is a digit 0-9 or ``[OP e1 ... ek ]`` with k in [2, max_args] and OP one of
MAX, MIN, MED (median, rounded down), SM (sum modulo 10). The label is the value, 10 classes.
Trees are grown as in LRA: below ``max_depth`` a node is an operator with probability 0.25 (else a
digit), the number of arguments is uniform in [2, max_args], and whole trees are drawn until their
token count lies in [min_len, max_len] (LRA: max_depth 10, max_args 10, lengths 500-2000).

Tokens are ids over the vocabulary ``VOCAB`` (id 0 is padding); LRA's parentheses, which carry no
information, are not emitted.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

import torch
from torch import Tensor

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
DIGITS = tuple(str(d) for d in range(10))
CLOSE = "]"
PAD = "<pad>"
VOCAB = (PAD, *DIGITS, *OPERATORS, CLOSE)
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
NUM_CLASSES = 10
# Probability that a node above max_depth is an operator (LRA's VALUE_P: a digit above 0.25).
OPERATOR_P = 0.25


class _TooLong(Exception):
    pass


def _apply(op: str, values: list[int]) -> int:
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[MED":
        return int(statistics.median(values))
    return sum(values) % 10


def _grow(rng: random.Random, depth: int, max_depth: int, max_args: int, out: list[str],
          max_len: int) -> int:
    """Append one subtree's tokens to ``out`` and return its value; abort past ``max_len``."""
    if depth < max_depth and rng.random() <= OPERATOR_P:
        op = OPERATORS[rng.randrange(len(OPERATORS))]
        out.append(op)
        values = [_grow(rng, depth + 1, max_depth, max_args, out, max_len)
                  for _ in range(rng.randint(2, max_args))]
        out.append(CLOSE)
        value = _apply(op, values)
    else:
        value = rng.randrange(10)
        out.append(DIGITS[value])
    if len(out) > max_len:
        raise _TooLong
    return value


def sample_expression(
    rng: random.Random,
    min_len: int,
    max_len: int,
    max_depth: int = 10,
    max_args: int = 10,
) -> tuple[list[str], int]:
    """One expression with min_len <= tokens <= max_len, and its value computed while growing."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if min_len > 1 and max_len < 4:
        raise ValueError(f"no expression has between {min_len} and {max_len} tokens")
    while True:
        out: list[str] = []
        try:
            value = _grow(rng, 1, max_depth, max_args, out, max_len)
        except _TooLong:
            continue
        if len(out) >= min_len:
            return out, value


def evaluate(tokens: Sequence[str]) -> int:
    """Value of a token sequence, by a stack machine over the flat tokens (independent of the
    generator's recursive computation; tests check one against the other)."""
    stack: list[list] = [["ROOT"]]
    for tok in tokens:
        if tok in OPERATORS:
            stack.append([tok])
        elif tok == CLOSE:
            if len(stack) < 2 or len(stack[-1]) < 3:
                raise ValueError("malformed ListOps: ']' without an operator of >= 2 arguments")
            op, *args = stack.pop()
            if op == "[MAX":
                value = max(args)
            elif op == "[MIN":
                value = min(args)
            elif op == "[MED":
                s = sorted(args)
                value = (s[(len(s) - 1) // 2] + s[len(s) // 2]) // 2
            else:
                value = sum(args) % 10
            stack[-1].append(value)
        elif tok in DIGITS:
            stack[-1].append(int(tok))
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if len(stack) != 1 or len(stack[0]) != 2:
        raise ValueError("malformed ListOps: unbalanced brackets or several expressions")
    return stack[0][1]


def encode(tokens: Sequence[str], length: int) -> list[int]:
    """Token ids, right-padded with 0 to ``length``."""
    if len(tokens) > length:
        raise ValueError(f"expression of {len(tokens)} tokens does not fit length {length}")
    return [TOKEN_ID[t] for t in tokens] + [0] * (length - len(tokens))


def decode(ids: Sequence[int]) -> list[str]:
    """Tokens of an id sequence, padding dropped."""
    return [VOCAB[i] for i in ids if i != 0]


def generate(
    count: int,
    *,
    seed: int,
    min_len: int,
    max_len: int,
    max_depth: int = 10,
    max_args: int = 10,
) -> tuple[Tensor, Tensor]:
    """``count`` examples, deterministic in ``seed``: (tokens (count, max_len) int64, labels)."""
    rng = random.Random(seed)
    rows, labels = [], []
    for _ in range(count):
        tokens, value = sample_expression(rng, min_len, max_len, max_depth, max_args)
        rows.append(encode(tokens, max_len))
        labels.append(value)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(labels, dtype=torch.long)
