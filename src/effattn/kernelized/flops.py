"""The FLOP model of kernelized attention, shared by the kernelized methods' specs.

Kept apart from :mod:`effattn.kernelized.core` so that the numeric core does not import the
registry.
"""

from __future__ import annotations

from dataclasses import replace

from effattn.registry import Problem


def kernelized_flops(
    problem: Problem, *, projections: int, feature_dim: int, chunk_size: int,
    window: int | None = None,
) -> float:
    """Matmul FLOPs of kernelized attention on ``problem``: the GEMMs the core runs.

    Per (B, H): the feature projections 2·(N + M)·P·D (P random projections; 0 for elementwise
    maps), then, non-causal, φ(K)^T [V, 1] and φ(Q) times that, 2·(N + M)·F·(Dv + 1). Causal, per
    chunk of C tokens (the last one padded): the masked C x C scores 2·C²·F and their product with
    [V, 1] 2·C²·(Dv + 1), the chunk's state delta and the queries against the state entering it,
    2·2·C·F·(Dv + 1) (the scan over chunks is elementwise).

    With a ``window`` (the hybrid of kernelized.hybrid): the window's scores and their product
    with V over its keys, 2·N·W'·(D + Dv) (W' = W causal, 2 (W // 2) + 1 otherwise), plus the
    causal form over the lagged keys, twice when non-causal (keys before and after the window);
    none while the window covers every key.
    """
    b, h, n, m, d, dv = (problem.batch, problem.heads, problem.n, problem.m, problem.head_dim,
                         problem.value_dim)
    f = problem.feature_dim or feature_dim
    features = (n + m) * projections * d
    if window is not None:
        reach = window if problem.causal else 2 * (window // 2) + 1
        lag = window if problem.causal else window // 2 + 1
        exact = 2.0 * b * h * n * min(reach, n) * (d + dv)
        if lag >= n:
            return exact
        passes = 1 if problem.causal else 2
        causal = replace(problem, causal=True)
        return exact + passes * kernelized_flops(causal, projections=projections,
                                                 feature_dim=feature_dim, chunk_size=chunk_size)
    if not problem.causal:
        return 2.0 * b * h * (features + (n + m) * f * (dv + 1))
    nc = -(-n // chunk_size)
    padded = nc * chunk_size
    intra = padded * chunk_size * (f + dv + 1)
    state = 2 * padded * f * (dv + 1)
    return 2.0 * b * h * (features + intra + state)
