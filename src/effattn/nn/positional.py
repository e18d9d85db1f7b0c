"""Sinusoidal absolute positional encodings (Vaswani et al. 2017, section 3.5).

PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)), added to the token
embeddings. Computed on the fly for any range of positions, so there is no maximum length and a
decoder stepping one token at a time asks for exactly the row of its current position.

Why not rotary: rotary embeddings rotate q and k inside attention, which changes what a kernel
feature map sees (the random-feature estimators of Performer/RFA approximate exp(q.k) for the
rotated vectors, and the RFA unit-norm step interacts with it). An additive encoding at the input
leaves every mechanism's contract untouched, so all methods are compared on the same footing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal(positions: Tensor, dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Encodings of integer ``positions`` (any shape S) -> (*S, dim), computed in float64.

    float64 keeps sin(p * w) accurate for large positions (p up to millions) before the cast.
    """
    if dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even int >= 2, got {dim!r}")
    freqs = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
        * (-math.log(10000.0) / dim)
    )
    angles = positions.to(torch.float64)[..., None] * freqs
    out = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    return out.to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds sinusoidal encodings of positions ``offset .. offset + N - 1`` to x (B, N, d)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        if d_model < 2 or d_model % 2:
            raise ValueError(f"d_model must be an even int >= 2, got {d_model!r}")
        self.d_model = d_model

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        positions = torch.arange(offset, offset + x.shape[1], device=x.device)
        return x + sinusoidal(positions, self.d_model, x.dtype)
