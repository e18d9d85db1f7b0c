"""Random projection matrices for random-feature attention.

Orthogonal random features (Choromanski et al. 2020, "Rethinking Attention with Performers",
section 2.4 and appendix): rows within each block of D are exactly orthogonal, which lowers the
variance of the kernel estimate compared with iid Gaussian rows at the same F.
"""

from __future__ import annotations

import torch
from torch import Tensor

from effattn.random import RandomSource, normal, resolve_seed


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from the global RNG when ``seed`` is None."""
    return torch.Generator().manual_seed(resolve_seed(seed))


def gaussian_projection(
    num_features: int,
    dim: int,
    *,
    orthogonal: bool,
    generator: RandomSource = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(F, D) matrix whose rows are marginally N(0, I_D).

    ``orthogonal=True`` stacks ceil(F / D) blocks, each the Q factor of the QR decomposition of a
    D x D Gaussian matrix (sign-corrected so it is Haar distributed), and scales each row by the
    norm of an independent Gaussian D-vector (chi(D) lengths), so each row keeps the N(0, I)
    marginal while rows within a block are orthogonal. Drawn in float64 on the CPU, then cast.
    ``generator``: see :data:`effattn.random.RandomSource`.
    """
    if num_features < 1 or dim < 1:
        raise ValueError(f"num_features and dim must be positive, got {num_features}, {dim}")
    if not orthogonal:
        w = normal(generator, num_features, dim)
        return w.to(dtype)
    n_blocks = -(-num_features // dim)
    g = normal(generator, n_blocks, dim, dim)
    q, r = torch.linalg.qr(g)  # one batched QR, not a Python loop over blocks
    # QR's Q is Haar only after fixing the signs of R's diagonal.
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    w = q.transpose(-2, -1).reshape(n_blocks * dim, dim)[:num_features]
    norms = normal(generator, num_features, dim).norm(dim=1)
    return (w * norms[:, None]).to(dtype)
