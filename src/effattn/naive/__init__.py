"""Naive dense references: explicit N x M matrices and masks, no tricks.

One module per family of mechanisms; each function is written from the formula, never by
calling a fast path's helpers, so that a bug in a shared helper cannot hide in both. The tests,
the approximation study (``effattn approx``) and each spec's ``reference`` binding use them;
nothing on the runtime path does: ``import effattn``, building and calling a method never import
this package (tested), a spec's ``reference`` imports its family when called.
"""

from effattn.naive.fourier import fnet_mixing
from effattn.naive.kernelized import (
    exponent_attention,
    favor_attention,
    hedgehog_attention,
    kernel_attention,
    kernel_weights,
    linear_transformer_attention,
    performer_attention,
    performer_features,
    rfa_attention,
    taylor_attention,
    window_hybrid,
)
from effattn.naive.lowrank import linformer_attention, nystrom_attention
from effattn.naive.lsh import reformer_attention, reformer_candidates
from effattn.naive.patterns import (
    bigbird_attention,
    local_attention,
    longformer_attention,
    sparse_fixed_attention,
    sparse_strided_attention,
)
from effattn.naive.sampled import random_subset_attention
from effattn.naive.softmax import dense_mask, softmax_attention

__all__ = [
    "bigbird_attention",
    "dense_mask",
    "exponent_attention",
    "favor_attention",
    "fnet_mixing",
    "hedgehog_attention",
    "kernel_attention",
    "kernel_weights",
    "linear_transformer_attention",
    "linformer_attention",
    "local_attention",
    "longformer_attention",
    "nystrom_attention",
    "performer_attention",
    "performer_features",
    "random_subset_attention",
    "reformer_attention",
    "reformer_candidates",
    "rfa_attention",
    "softmax_attention",
    "sparse_fixed_attention",
    "sparse_strided_attention",
    "taylor_attention",
    "window_hybrid",
]
