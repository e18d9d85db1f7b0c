"""The method registry: one name -> one :class:`MethodSpec` and one module class.

Every mechanism lives in ``effattn/mechanisms/<name>.py`` (the subpackage is not named
``methods``: that is the function listing the names) and calls :func:`register` at the bottom of
its file with everything the rest of the package asks about it: capabilities and options, the FLOP
model, the budget the approximation study sweeps, variants worth comparing, the hints a layer
needs (a parameter-free mixer, a call-time gate), its dense reference and how it is split along
the sequence across ranks. The layers, tools and command line consult only this registry; no
other module names a method. ``effattn.mechanisms`` imports every module of that package, so
adding a file is all it takes to add a method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from effattn.base import AttentionMethod

# Constructor arguments every method takes, besides its own options.
COMMON_OPTIONS = ("scale",)
# The exact method: the contract's default (shared/design.md) and the baseline every tool
# compares against. The one place outside its own module that names a method.
DEFAULT_METHOD = "softmax"


@dataclass(frozen=True)
class Problem:
    """The shape of one attention call, as a FLOP model counts it.

    q (batch, heads, n, head_dim), k (batch, heads, m, head_dim), v (batch, heads, m, value_dim).
    ``feature_dim`` is the F of kernelized methods when a built module knows it (paired feature
    maps double the projections), else None.
    """

    batch: int
    heads: int
    n: int
    m: int
    head_dim: int
    value_dim: int
    causal: bool = False
    feature_dim: int | None = None


# FLOP model: (options with defaults merged in, problem) -> matmul FLOPs of one forward call.
FlopModel = Callable[[Mapping[str, Any], Problem], float]
# The output a method approximates in the error study: (q, k, v, scale, options) -> (B, H, N, Dv).
TargetFn = Callable[["Tensor", "Tensor", "Tensor", float, Mapping[str, Any]], "Tensor"]
# A module's dense reference: reference(module, q, k, v, *, causal=False, key_padding_mask=None,
# **call) -> (B, H, N, Dv), ``call`` being the module's call-time arguments (``gate=``, and those
# of LayerHints.call_inputs).
ReferenceFn = Callable[..., "Tensor"]
# How effattn.distributed splits a method along the sequence (see distributed/sequence.py):
# "state": kernelized, ranks exchange fixed-size key states; "gather": every rank all-gathers K
# and V; "halo": a window, ranks exchange the tokens at their slice borders.
SEQUENCE_PARALLEL = ("state", "gather", "halo")
# Keyword inputs a mechanism may take at call time (forward, and step/prefill when it decodes)
# besides the gate, declared in LayerHints.call_inputs:
# - "window": int, the caller requires causal attention restricted to a sliding window,
#   query i sees key j iff 0 <= i - j < window; the mechanism computes exactly that pattern or
#   raises ValueError;
# - "sinks": (H,) float, one sink logit per head in the normaliser and no value,
#   out_i = sum_j e^{s_ij} v_j / (e^{sink_h} + sum_j e^{s_ij}) (GPT-OSS's attention sinks).
CALL_INPUTS = ("window", "sinks")


@dataclass(frozen=True)
class Budget:
    """The option that buys accuracy, and the grid ``effattn approx`` sweeps by default.

    ``target`` is the output the method approximates (None: exact softmax attention); ``note``
    qualifies the method's errors in the study's records.
    """

    option: str
    grid: tuple[Any, ...]
    target: TargetFn | None = None
    note: str = ""


@dataclass(frozen=True)
class LayerHints:
    """What a layer around the mechanism must do differently.

    ``parameter_free``: the mechanism mixes the sequence itself (no queries, keys or values), so
    the layer has no projections and hands it the whole embedding as one head.
    ``gate_option``: the option that, when true, makes the mechanism take a per-head gate
    ``gate=`` (B, H, N) in (0, 1) at call time; such a gate exists for causal self-attention only,
    so encoders and cross-attention build the mechanism without it.
    ``call_inputs``: the names of :data:`CALL_INPUTS` its forward (and step/prefill) take.
    """

    parameter_free: bool = False
    gate_option: str | None = None
    call_inputs: tuple[str, ...] = ()

    def gated(self, options: Mapping[str, Any]) -> bool:
        """Whether ``options`` (defaults merged in) ask for the call-time gate."""
        return self.gate_option is not None and bool(options.get(self.gate_option, False))

    def ungated(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` without the gate: the mechanism for encoders and cross-attention."""
        return {k: v for k, v in options.items() if k != self.gate_option}


@dataclass(frozen=True)
class Variant:
    """A setting of a method's options that the tools run beside its defaults.

    ``decoding``: its decoding step costs differ from the default's (``effattn decode`` runs it).
    """

    options: Mapping[str, Any]
    decoding: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


@dataclass(frozen=True)
class MethodSpec:
    """What a mechanism is and what it can do.

    ``causal``, ``padding_mask``, ``cross`` and ``decoding`` are promises: a method whose spec says
    False raises ``ValueError`` (with ``refusals[capability]`` as the reason) instead of computing
    something wrong. ``options`` maps each option the method accepts to its default.

    ``reference`` computes densely, from ``effattn.reference``'s naive formulas (O(N M) memory,
    float64-friendly), exactly what a module computes in eval mode on inputs it accepts, with that
    module's own parameters, buffers and eval-mode random draws: the tests hold every module to it.
    ``sequence_parallel`` is one of :data:`SEQUENCE_PARALLEL`, or None: the method cannot be split
    along the sequence, for the reason in ``refusals["sequence_parallel"]``.
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
    flops: FlopModel | None = None
    budget: Budget | None = None
    variants: tuple[Variant, ...] = ()
    layer: LayerHints = LayerHints()
    bench_default: bool = False
    published: Mapping[str, float] = field(default_factory=dict)
    reference: ReferenceFn | None = None
    sequence_parallel: str | None = None

    def __post_init__(self) -> None:
        for name in ("options", "refusals", "published"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        for capability in ("causal", "padding_mask", "cross", "decoding"):
            if not getattr(self, capability) and capability not in self.refusals:
                raise ValueError(
                    f"MethodSpec {self.name!r}: {capability}=False needs a reason in refusals"
                )
        if self.sequence_parallel is None and "sequence_parallel" not in self.refusals:
            raise ValueError(
                f"MethodSpec {self.name!r}: sequence_parallel=None needs a reason in refusals"
            )
        if self.sequence_parallel is not None and self.sequence_parallel not in SEQUENCE_PARALLEL:
            raise ValueError(
                f"MethodSpec {self.name!r}: sequence_parallel must be one of {SEQUENCE_PARALLEL} "
                f"or None, got {self.sequence_parallel!r}"
            )
        named = [o for v in self.variants for o in v.options]
        if self.budget is not None:
            named.append(self.budget.option)
        if self.layer.gate_option is not None:
            named.append(self.layer.gate_option)
        unknown = sorted(set(named) - set(self.options) - set(COMMON_OPTIONS))
        if unknown:
            raise ValueError(f"MethodSpec {self.name!r} names unknown option(s) {unknown}")
        unknown = sorted(set(self.layer.call_inputs) - set(CALL_INPUTS))
        if unknown:
            raise ValueError(
                f"MethodSpec {self.name!r} declares unknown call input(s) {unknown}; "
                f"known: {', '.join(CALL_INPUTS)}"
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
    import effattn.mechanisms  # noqa: F401  (importing registers every method)


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
