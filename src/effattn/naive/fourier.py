"""FNet's Fourier mixing with the explicit DFT matrices."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def fnet_mixing(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Re(W_N v W_Dv) with the explicit DFT matrices W_L[j, t] = exp(-2 pi i j t / L)."""
    def dft(length: int) -> Tensor:
        j = torch.arange(length, dtype=torch.float64, device=v.device)
        angle = -2 * math.pi * torch.outer(j, j).remainder(length) / length
        return torch.polar(torch.ones_like(angle), angle)

    cdtype = torch.complex128 if v.dtype == torch.float64 else torch.complex64
    w_n, w_d = dft(v.shape[2]).to(cdtype), dft(v.shape[3]).to(cdtype)
    return (w_n @ v.to(cdtype) @ w_d).real
