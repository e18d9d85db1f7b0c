"""effattn: efficient attention mechanisms behind one contract.

>>> import effattn, torch
>>> q = k = v = torch.randn(1, 8, 128, 64)
>>> out = effattn.attention(q, k, v, method="performer", num_features=128, seed=0)
"""

import effattn.mechanisms  # noqa: F401  (registers every method)
from effattn.base import AttentionMethod
from effattn.functional import attention
from effattn.registry import MethodSpec, build, methods, register, spec

__all__ = ["AttentionMethod", "MethodSpec", "attention", "build", "methods", "register", "spec"]
__version__ = "0.2.0"
