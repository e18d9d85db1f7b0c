"""Functional form of the contract: ``effattn.attention(q, k, v, method=...)``."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from effattn import base
from effattn.registry import DEFAULT_METHOD, build, spec


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    method: str = DEFAULT_METHOD,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    *,
    seed: int | None = None,
    **options: Any,
) -> Tensor:
    """``build(method, ...)`` for q's shape, in eval mode, applied once.

    A convenience for one-off calls: methods with parameters or random features are built afresh
    each call (fix ``seed`` for repeatable random features). Keep a module from :func:`build` to
    reuse them. Keywords that the method's spec declares in ``call_inputs`` go to the forward
    call, the others to :func:`build`.
    """
    # The layout only: the module's forward checks the values, and each check is a host sync.
    base._check_qkv_layout(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
    declared = {c.name for c in spec(method).call_inputs}
    call = {name: options.pop(name) for name in list(options) if name in declared}
    module = build(
        method,
        head_dim=q.shape[-1],
        heads=q.shape[1],
        max_len=max(q.shape[2], k.shape[2]),
        seed=seed,
        **options,
    )
    module = module.to(q.device).eval()
    return module(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **call)
