"""The method registry: one name -> one :class:`MethodSpec` and one module class.

Every mechanism lives in ``effattn/mechanisms/<name>.py`` (the subpackage is not named
``methods``: that is the function listing the names) and calls :func:`register` at the bottom of
its file with everything the rest of the package asks about it: capabilities and options, the FLOP
model, the budget the approximation study sweeps, variants worth comparing, the tensors it takes at
call time besides q, k and v, the hints a layer needs, its dense reference and how it is split
along the sequence across ranks. The layers, tools and command line consult only this registry; no
other module names a method. ``effattn.mechanisms`` imports every module of that package, so
adding a file is all it takes to add a method.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from effattn.parallel import SequenceStrategy

if TYPE_CHECKING:
    from torch import Tensor

    from effattn.base import AttentionMethod

# Constructor arguments every method takes, besides its own options.
COMMON_OPTIONS = ("scale",)
# The exact method: the contract's default (docs/methods.md, "The contract") and the baseline
# every tool compares against. The one place outside its own module that names a method.
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
# **call) -> (B, H, N, Dv), ``call`` holding the call inputs the module was given (CallInput).
ReferenceFn = Callable[..., "Tensor"]


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


# The letters a CallInput's shape is written in, resolved against the call's q (B, H, N, D),
# k (B, H, M, D) and v (B, H, M, Dv); N is 1 in ``step`` and L in ``prefill``.
SHAPE_LETTERS = ("B", "H", "N", "M", "D", "Dv")
# Names a call input cannot take: the arguments of forward, step, build and effattn.attention.
RESERVED_NAMES = frozenset({"q", "k", "v", "causal", "key_padding_mask", "state", "method",
                            "seed", "head_dim", "heads", "max_len", *COMMON_OPTIONS})


# The kinds of value a call input takes: a floating-point tensor of its ``shape``, or a Python
# int (``shape=()``), a structural setting such as a sliding window that decides which keys a
# query sees (torch.compile specialises on it, as on ``causal``).
CALL_INPUT_KINDS = ("tensor", "int")


@dataclass(frozen=True)
class CallInput:
    """A value a module takes at call time besides q, k and v: a keyword of ``forward``,
    ``step`` and ``prefill`` (and of ``effattn.attention``), checked by ``AttentionMethod``.

    ``kind`` (:data:`CALL_INPUT_KINDS`): a floating-point ``"tensor"``, or an ``"int"`` with
    ``shape=()``. ``shape`` spells a tensor's dimensions in :data:`SHAPE_LETTERS`
    (``("B", "H", "N")``: one value per batch, head and query). ``enabled_by`` names the bool
    option that makes the module take it: the input is then required, and refused while the
    option is off; None: the module always accepts it, and it is optional. ``causal_only``:
    defined for causal attention only (with ``causal=True``; ``step`` and ``prefill`` are causal).
    ``bounds``: the closed interval its values must lie in, or None; a tensor's values are
    checked (finite, within bounds) in eager mode only, an int always. A layer around the
    mechanism computes each required input (``effattn.nn``, by ``name``).
    """

    name: str
    doc: str
    shape: tuple[str, ...]
    enabled_by: str | None = None
    causal_only: bool = False
    bounds: tuple[float, float] | None = None
    kind: str = "tensor"

    @property
    def required(self) -> bool:
        """Whether a module that takes it must be given it (it has an ``enabled_by`` option)."""
        return self.enabled_by is not None

    def enabled(self, options: Mapping[str, Any]) -> bool:
        """Whether a module built with ``options`` (defaults merged in) takes it."""
        return self.enabled_by is None or bool(options.get(self.enabled_by, False))

    def expected_shape(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """``shape`` with each letter replaced by its size in ``dims``."""
        return tuple(dims[letter] for letter in self.shape)


@dataclass(frozen=True)
class LayerHints:
    """What a layer around the mechanism must do differently.

    ``parameter_free``: the mechanism mixes the sequence itself (no queries, keys or values), so
    the layer has no projections and hands it the whole embedding as one head.
    """

    parameter_free: bool = False


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

    ``reference`` computes densely, from the naive formulas of ``effattn.naive`` (O(N M) memory,
    float64-friendly), exactly what a module computes in eval mode on inputs it accepts, with that
    module's own parameters, buffers and eval-mode random draws: the tests hold every module to it.
    ``sequence_parallel`` is the :class:`~effattn.parallel.SequenceStrategy` that computes the
    method over a sequence split across ranks, provided by its engine (the kernelized core's
    state exchange, the banded engine's halos), or None: the method cannot be split along the
    sequence, for the reason in ``refusals["sequence_parallel"]``.
    ``call_inputs`` declares the tensors a module takes at call time besides q, k and v.
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
    call_inputs: tuple[CallInput, ...] = ()
    bench_default: bool = False
    published: Mapping[str, float] = field(default_factory=dict)
    reference: ReferenceFn | None = None
    sequence_parallel: SequenceStrategy | None = None

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
        if self.sequence_parallel is not None and not isinstance(
                self.sequence_parallel, SequenceStrategy):
            raise ValueError(
                f"MethodSpec {self.name!r}: sequence_parallel must be a SequenceStrategy or "
                f"None, got {self.sequence_parallel!r}"
            )
        named = [o for v in self.variants for o in v.options]
        if self.budget is not None:
            named.append(self.budget.option)
        named += [c.enabled_by for c in self.call_inputs if c.enabled_by is not None]
        unknown = sorted(set(named) - set(self.options) - set(COMMON_OPTIONS))
        if unknown:
            raise ValueError(f"MethodSpec {self.name!r} names unknown option(s) {unknown}")
        names = [c.name for c in self.call_inputs]
        clash = sorted({n for n in names if names.count(n) > 1 or n in self.options}
                       | (set(names) & RESERVED_NAMES))
        if clash:
            raise ValueError(
                f"MethodSpec {self.name!r}: call input name(s) {clash} repeat, or are an option "
                "or an argument of forward, step, build or effattn.attention"
            )
        for c in self.call_inputs:
            if c.kind not in CALL_INPUT_KINDS:
                raise ValueError(
                    f"MethodSpec {self.name!r}: call input {c.name!r} has kind {c.kind!r}; "
                    f"kinds: {', '.join(CALL_INPUT_KINDS)}"
                )
            if c.kind == "int" and c.shape != ():
                raise ValueError(
                    f"MethodSpec {self.name!r}: call input {c.name!r} is an int: shape=()"
                )
            if c.kind == "tensor" and (not c.shape or not set(c.shape) <= set(SHAPE_LETTERS)):
                raise ValueError(
                    f"MethodSpec {self.name!r}: call input {c.name!r} has shape {c.shape}; "
                    f"spell it in {SHAPE_LETTERS}"
                )

    def enabled_inputs(self, options: Mapping[str, Any]) -> tuple[CallInput, ...]:
        """The call inputs a module built with ``options`` takes (the defaults fill the rest)."""
        merged = {**self.options, **options}
        return tuple(c for c in self.call_inputs if c.enabled(merged))

    def required_inputs(self, options: Mapping[str, Any]) -> tuple[CallInput, ...]:
        """Those of :meth:`enabled_inputs` that each call must give: what a layer computes."""
        return tuple(c for c in self.enabled_inputs(options) if c.required)

    def non_causal_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` without those that turn on a causal-only call input: the mechanism as
        encoders and cross-attention use it, where such an input does not exist."""
        switches = {c.enabled_by for c in self.call_inputs if c.causal_only}
        return {k: v for k, v in options.items() if k not in switches}


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
        inputs = [c.name for c in method_spec.call_inputs if c.name in unknown]
        at_call = f"; {', '.join(inputs)} go(es) to the call, not to build" if inputs else ""
        raise TypeError(
            f"method {name!r} got unknown option(s) {', '.join(unknown)}; it accepts: {known}"
            f" (and {', '.join(COMMON_OPTIONS)}){at_call}"
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
