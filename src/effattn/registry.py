"""The method registry: one name -> one :class:`MethodSpec` and one module class.

Every mechanism lives in ``effattn/methods/<name>.py`` and calls :func:`register` at the bottom of
its file. ``effattn.methods`` imports every module of that package, so adding a file is all it
takes to add a method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from effattn.base import AttentionMethod

# Constructor arguments every method takes, besides its own options.
COMMON_OPTIONS = ("scale",)


@dataclass(frozen=True)
class MethodSpec:
    """What a mechanism is and what it can do.

    ``causal``, ``padding_mask``, ``cross`` and ``decoding`` are promises: a method whose spec says
    False raises ``ValueError`` (with ``refusals[capability]`` as the reason) instead of computing
    something wrong. ``options`` maps each option the method accepts to its default.
    """

    name: str
    summary: str
    paper: str
    complexity: str
    causal: bool
    padding_mask: bool
    cross: bool
    decoding: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    refusals: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        object.__setattr__(self, "refusals", MappingProxyType(dict(self.refusals)))
        for capability in ("causal", "padding_mask", "cross", "decoding"):
            if not getattr(self, capability) and capability not in self.refusals:
                raise ValueError(
                    f"MethodSpec {self.name!r}: {capability}=False needs a reason in refusals"
                )


_REGISTRY: dict[str, tuple[MethodSpec, type[AttentionMethod]]] = {}


def register(spec: MethodSpec, cls: type[AttentionMethod]) -> type[AttentionMethod]:
    """Register ``cls`` under ``spec.name``; the class gets ``cls.spec = spec``."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name][1] is not cls:
        raise ValueError(f"method {spec.name!r} is already registered")
    cls.spec = spec
    _REGISTRY[spec.name] = (spec, cls)
    return cls


def _ensure_loaded() -> None:
    import effattn.methods  # noqa: F401  (importing registers every method)


def methods() -> list[str]:
    """Names of all registered methods, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[MethodSpec, type[AttentionMethod]]:
    _ensure_loaded()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise KeyError(f"unknown attention method {name!r}; valid names: {', '.join(methods())}")
    return _REGISTRY[name]


def spec(name: str) -> MethodSpec:
    """The :class:`MethodSpec` of ``name``; ``KeyError`` listing valid names if unknown."""
    return _lookup(name)[0]


def build(
    name: str,
    head_dim: int = 64,
    heads: int = 8,
    max_len: int | None = None,
    seed: int | None = None,
    **options: Any,
) -> AttentionMethod:
    """Instantiate method ``name`` as an ``nn.Module``.

    ``options`` must be among ``spec(name).options`` (or ``scale``); anything else raises
    ``TypeError``. ``seed`` fixes every random draw the method makes (features, hashes, blocks).
    """
    method_spec, cls = _lookup(name)
    unknown = sorted(set(options) - set(method_spec.options) - set(COMMON_OPTIONS))
    if unknown:
        known = ", ".join(sorted(method_spec.options)) or "none"
        raise TypeError(
            f"method {name!r} got unknown option(s) {', '.join(unknown)}; it accepts: {known}"
            f" (and {', '.join(COMMON_OPTIONS)})"
        )
    for arg, value in (("head_dim", head_dim), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    if max_len is not None and (
        isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
    ):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    merged = {**method_spec.options, **options}
    return cls(head_dim=head_dim, heads=heads, max_len=max_len, seed=seed, **merged)
