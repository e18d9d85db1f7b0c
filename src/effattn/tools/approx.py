"""How close each method comes to exact attention, and the Performer paper's kernel-MSE study.

Output error: for each method and each value of its budget option (features, landmarks, window,
hashes, ...), the relative Frobenius error ``‖out − exact‖_F / ‖exact‖_F`` of the whole output
(B, H, N, Dv), in float64 (so only the approximation, not rounding, is measured), mean and std
over seeds. The seed fixes both the data and the method's random draws. The exact target is
``softmax(scale q k^T) v`` (the naive dense reference), unless the method's
:class:`~effattn.registry.Budget` names its own target (rfa: ``softmax(q̂ k̂^T / sigma^2) v`` with
q̂, k̂ the unit-length q, k; see ``effattn.mechanisms.rfa``). The budget option and its default
grid come from each method's spec. Data sets:

- ``gaussian qk_std=s``: q, k ~ N(0, s^2), v ~ N(0, 1); the logits have std about s^2.
- ``peaked logit=L``: q, k ~ N(0, 1) plus a few planted pairs: P = 4 keys get a large component
  along unit directions u_1..u_P, and every query gets the same component along one of them, so
  each query has one logit of about L on top of the N(0, 1)-ish rest (a few dominant keys, as in
  trained attention).

Learned feature maps (a module whose ``feature_parameters()`` names parameters, e.g. Hedgehog's
W and b) are measured as built, or, with ``fit_steps`` > 0, after fitting those parameters by
attention distillation (Zhang et al. 2024) on the very q, k they are then measured on: Adam
(rate :data:`FIT_LR`) on the cross-entropy between softmax(scale q kᵀ) and the map's normalised
weights φ(q_i)·φ(k_j) / Σ_j φ(q_i)·φ(k_j), in fp32, then measured in float64
(:func:`distill`). That is the best case for a learned map (fitted and tested on the same
tokens): a bound on what distillation can reach, not a held-out error.

Kernel MSE (Choromanski et al. 2020, "Rethinking Attention with Performers", section 2.3-2.4):
for x, y in R^d with |x| = |y| = r, the softmax kernel SM(x, y) = exp(x·y) is estimated with m
random projections w_1..w_m ~ N(0, I_d) by

- positive features  phi+(u) = exp(-|u|^2/2) / sqrt(m) · [exp(w_i·u)]_i,  SM ≈ phi+(x)·phi+(y):
  unbiased since E exp(w·z) = exp(|z|^2/2); for iid w its MSE is
  SM^2 (exp(|x + y|^2) - 1) / m, which vanishes as SM -> 0;
- trigonometric features  phi_t(u) = exp(|u|^2/2) / sqrt(m) · [sin(w_i·u), cos(w_i·u)]_i
  (2m dimensions), SM ≈ phi_t(x)·phi_t(y) = exp((|x|^2 + |y|^2)/2) mean_i cos(w_i·(x − y)):
  unbiased since E cos(w·z) = exp(-|z|^2/2); for iid w its MSE is
  exp(|x|^2 + |y|^2) (1 − exp(−|x − y|^2))^2 / (2m), which does not vanish as SM -> 0;

each with iid or block-orthogonal projections
(:func:`effattn.kernelized.projections.gaussian_projection`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import effattn
from effattn import naive
from effattn.kernelized.projections import gaussian_projection, make_generator
from effattn.registry import Budget

PEAKS = 4
APPROX_FIELDS = ("method", "option", "budget", "dataset", "status", "mean", "std", "min", "max",
                 "seeds", "length", "heads", "head_dim", "fit_steps", "note")
# Adam's rate in :func:`distill`: 200 steps at 0.01 took Hedgehog's map from 0.99 to 0.07 of
# output error on peaked attention, and larger rates were no faster on the Gaussian data sets.
FIT_LR = 0.01
KERNEL_FIELDS = ("sweep", "estimator", "projection", "m", "angle_deg", "norm", "dim", "pairs",
                 "draws", "mse", "mse_theory_iid", "kernel_mean")


def make_inputs(
    dataset: str,
    *,
    heads: int,
    n: int,
    d: int,
    seed: int,
    qk_std: float = 1.0,
    peak_logit: float = 8.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (1, H, N, D) in float64 for ``dataset`` "gaussian" or "peaked"."""
    g = torch.Generator().manual_seed(10_007 + seed)
    shape = (1, heads, n, d)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    if dataset == "gaussian":
        return q * qk_std, k * qk_std, v
    if dataset != "peaked":
        raise ValueError(f"dataset must be 'gaussian' or 'peaked', got {dataset!r}")
    # scale * a^2 = peak_logit for a query and its planted key (scale = 1/sqrt(D)).
    a = math.sqrt(peak_logit * math.sqrt(d))
    u = torch.randn(heads, PEAKS, d, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    positions = torch.randperm(n, generator=g)[:PEAKS]
    k[0, :, positions] += a * u
    choice = torch.randint(0, PEAKS, (heads, n), generator=g)
    q[0] += a * torch.gather(u, 1, choice[..., None].expand(heads, n, d))
    return q, k, v


def budgets() -> dict[str, Budget]:
    """Method -> its budget, for every registered method whose error a budget controls."""
    return {m: b for m in effattn.methods() if (b := effattn.spec(m).budget) is not None}


def exact_output(method: str, options: Mapping[str, Any], q: Tensor, k: Tensor, v: Tensor,
                 scale: float) -> Tensor:
    """The output ``method`` approximates: its budget's target, else exact softmax attention.

    ``options`` override the method's defaults.
    """
    budget = budgets().get(method)
    if budget is None or budget.target is None:
        return naive.softmax_attention(q, k, v, scale=scale)
    return budget.target(q, k, v, scale, {**effattn.spec(method).options, **options})


def distill(module: torch.nn.Module, q: Tensor, k: Tensor, *, steps: int,
            lr: float = FIT_LR) -> float:
    """Fit ``module.feature_parameters()`` by attention distillation on q, k (B, H, N, D), in
    place, with ``steps`` Adam steps; returns the last cross-entropy.

    The loss is -Σ_j softmax(scale q kᵀ)_ij log(φ(q_i)·φ(k_j) / Σ_j φ(q_i)·φ(k_j)), averaged
    over the queries, from the module's own features (keys at their log-scale relative to the
    largest, which cancels in the ratio); a weight that underflows to 0 is taken at the dtype's
    smallest normal number, so that its log stays finite.
    """
    params = list(module.feature_parameters())
    optimizer = torch.optim.Adam(params, lr=lr)
    with torch.no_grad():
        teacher = torch.softmax(module.scale * q @ k.transpose(-2, -1), -1)
    loss = torch.zeros(())
    for _ in range(steps):
        phi_q, _ = module.features(q, is_query=True)
        phi_k, log_scale = module.features(k, is_query=False)
        if log_scale is not None:
            phi_k = phi_k * torch.exp(log_scale - log_scale.amax(-2, keepdim=True))
        a = (phi_q @ phi_k.transpose(-2, -1)).clamp_min(torch.finfo(q.dtype).tiny)
        loss = -(teacher * (a.log() - a.sum(-1, keepdim=True).log())).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def _learned(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a feature map with parameters to fit (see :func:`distill`)."""
    return bool(list(getattr(module, "feature_parameters", tuple)()))


def relative_error(out: Tensor, target: Tensor) -> float:
    return float((out - target).norm() / target.norm())


def _summary(errors: Sequence[float]) -> dict[str, float]:
    t = torch.tensor(errors, dtype=torch.float64)
    return {"mean": float(t.mean()), "std": float(t.std()) if len(errors) > 1 else 0.0,
            "min": float(t.min()), "max": float(t.max())}


def datasets(qk_stds: Iterable[float], peak_logit: float | None) -> list[tuple[str, dict]]:
    """(name, make_inputs keywords) of every data set of the study."""
    out = [(f"gaussian qk_std={s:g}", {"dataset": "gaussian", "qk_std": s}) for s in qk_stds]
    if peak_logit is not None:
        out.append((f"peaked logit={peak_logit:g}",
                    {"dataset": "peaked", "peak_logit": peak_logit}))
    return out


def output_error_study(
    grids: Mapping[str, Sequence[Any]],
    *,
    length: int = 512,
    heads: int = 4,
    head_dim: int = 64,
    seeds: int = 5,
    qk_stds: Sequence[float] = (0.25, 0.5, 1.0),
    peak_logit: float | None = 8.0,
    fit_steps: int = 0,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Relative output error for every (method, budget in ``grids[method]``, data set).

    A budget the method rejects (e.g. more landmarks than tokens) is recorded as "refused: ...".
    ``fit_steps`` > 0: learned feature maps are first fitted on each seed's q, k
    (:func:`distill`), and their records say so (``fit_steps``, ``note``).
    ``progress`` (a tqdm bar or None) is advanced once per (method, budget, data set).
    """
    records = []
    targets: dict[tuple, Tensor] = {}  # exact outputs, shared by methods with the same target
    sets = datasets(qk_stds, peak_logit)
    inputs = {(name, s): make_inputs(heads=heads, n=length, d=head_dim, seed=s, **kw)
              for name, kw in sets for s in range(seeds)}
    known = budgets()
    for method, grid in grids.items():
        if method not in known:
            raise ValueError(f"{method} has no budget option to sweep")
        method_budget = known[method]
        option = method_budget.option
        for budget in grid:
            for name, _ in sets:
                errors, status, fitted = [], "ok", 0
                for s in range(seeds):
                    q, k, v = inputs[(name, s)]
                    try:
                        module = effattn.build(method, head_dim=head_dim, heads=heads,
                                               max_len=length, seed=s, **{option: budget}).eval()
                        if fit_steps and _learned(module):
                            # Fitted in fp32 (fast), measured in float64 like every method.
                            distill(module.float(), q.float(), k.float(), steps=fit_steps)
                            module.double()
                            fitted = fit_steps
                        with torch.no_grad():
                            out = module(q, k, v)
                    except (ValueError, TypeError) as err:
                        status = "refused: " + " ".join(str(err).split())
                        break
                    # Methods with the exact softmax target share it; the others get their own.
                    key = (name, s, module.scale,
                           None if method_budget.target is None else method)
                    if key not in targets:
                        targets[key] = exact_output(method, {option: budget}, q, k, v,
                                                    module.scale)
                    errors.append(relative_error(out, targets[key]))
                record = {"method": method, "option": option, "budget": budget, "dataset": name,
                          "status": status, "mean": None, "std": None, "min": None, "max": None,
                          "seeds": len(errors), "length": length, "heads": heads,
                          "head_dim": head_dim, "fit_steps": fitted,
                          "note": (f"map fitted by attention distillation ({fitted} Adam steps "
                                   "on the measured q, k)" if fitted else method_budget.note)}
                if status == "ok":
                    record.update(_summary(errors))
                records.append(record)
                if progress is not None:
                    progress.update(1)
    return records


def positive_features(x: Tensor, w: Tensor) -> Tensor:
    """phi+(x) = exp(w_i·x − |x|^2/2) / sqrt(m): x (P, d), w (..., m, d) -> (..., P, m)."""
    sq = (x * x).sum(-1, keepdim=True)
    return torch.exp(x @ w.transpose(-1, -2) - sq / 2) / math.sqrt(w.shape[-2])


def trig_features(x: Tensor, w: Tensor) -> Tensor:
    """phi_t(x) = exp(|x|^2/2) / sqrt(m) [sin(w_i·x), cos(w_i·x)]: x (P, d), w (..., m, d)
    -> (..., P, 2m)."""
    sq = (x * x).sum(-1, keepdim=True)
    proj = x @ w.transpose(-1, -2)
    return torch.exp(sq / 2) * torch.cat([proj.sin(), proj.cos()], -1) / math.sqrt(w.shape[-2])


FEATURE_MAPS = {"positive": positive_features, "trig": trig_features}


def theory_mse_iid(estimator: str, x: Tensor, y: Tensor, m: int) -> Tensor:
    """Closed-form MSE of the iid estimators (see the module docstring), per pair (P,)."""
    sm = torch.exp((x * y).sum(-1))
    if estimator == "positive":
        return sm**2 * torch.expm1(((x + y) ** 2).sum(-1)) / m
    sq = (x * x).sum(-1) + (y * y).sum(-1)
    return torch.exp(sq) * (-torch.expm1(-((x - y) ** 2).sum(-1))) ** 2 / (2 * m)


def _pairs_with_angle(p: int, d: int, norm: float, angle: float | None,
                      g: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(p, d, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    y = torch.randn(p, d, generator=g, dtype=torch.float64)
    if angle is None:
        y = y / y.norm(dim=-1, keepdim=True)
    else:  # a unit vector at exactly ``angle`` from x, in a random plane through x
        y = y - (y * x).sum(-1, keepdim=True) * x
        y = math.cos(angle) * x + math.sin(angle) * y / y.norm(dim=-1, keepdim=True)
    return norm * x, norm * y


def _kernel_mse(x: Tensor, y: Tensor, m: int, orthogonal: bool, draws: int,
                seed: int) -> dict[str, float]:
    """Empirical MSE (mean over pairs of the mean over draws) of both estimators.

    The ``draws`` projections come from one ``gaussian_projection(draws * m, d)`` call cut into
    (draws, m, d): each draw is distributed as ``gaussian_projection(m, d)`` up to the order of its
    rows (which the estimators ignore); draws that share a QR block are weakly dependent, which
    leaves the MSE estimate unbiased.
    """
    w = gaussian_projection(draws * m, x.shape[1], orthogonal=orthogonal,
                            generator=make_generator(seed), dtype=torch.float64)
    w = w.reshape(draws, m, x.shape[1])
    exact = torch.exp((x * y).sum(-1))
    out = {}
    for name, phi in FEATURE_MAPS.items():
        estimate = (phi(x, w) * phi(y, w)).sum(-1)  # (draws, P)
        out[name] = float(((estimate - exact) ** 2).mean())
    return out


def draws_for(m: int, draws: int) -> int:
    """Draws at m projections: more for small m, where one draw is cheap and the estimate is
    noisiest (at least ``draws``, and ``draws * 64 / m`` below m = 64)."""
    return max(draws, math.ceil(draws * 64 / m))


def kernel_mse_study(
    *,
    dim: int = 16,
    norm: float = 1.0,
    features: Sequence[int] = (4, 8, 16, 32, 64, 128, 256, 512, 1024),
    angle_m: int = 64,
    angles_deg: Sequence[float] = tuple(range(10, 180, 10)),
    pairs: int = 32,
    draws: int = 200,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """MSE of exp(x·y) estimates for positive/trig features and orthogonal/iid projections.

    "features" sweep: ``pairs`` random pairs with |x| = |y| = ``norm``, m in ``features``.
    "angle" sweep: m = ``angle_m``, pairs at each angle in ``angles_deg``. Runs single-threaded:
    its tensors are tiny and a thread pool only adds overhead.
    """
    g = torch.Generator().manual_seed(seed)
    rand_x, rand_y = _pairs_with_angle(pairs, dim, norm, None, g)
    points = [("features", m, None, rand_x, rand_y) for m in features]
    points += [("angle", angle_m, a, *_pairs_with_angle(pairs, dim, norm, math.radians(a), g))
               for a in angles_deg]
    records = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for index, (sweep, m, angle, x, y) in enumerate(points):
            n_draws = draws_for(m, draws)
            for projection in ("orthogonal", "iid"):
                mse = _kernel_mse(x, y, m, projection == "orthogonal", n_draws,
                                  seed * 7919 + 2 * index + (projection == "iid"))
                for estimator in FEATURE_MAPS:
                    records.append({
                        "sweep": sweep, "estimator": estimator, "projection": projection,
                        "m": m, "angle_deg": angle, "norm": norm, "dim": dim, "pairs": pairs,
                        "draws": n_draws, "mse": mse[estimator],
                        "mse_theory_iid": float(theory_mse_iid(estimator, x, y, m).mean()),
                        "kernel_mean": float(torch.exp((x * y).sum(-1)).mean()),
                    })
    finally:
        torch.set_num_threads(threads)
    return records


def approx_table(records: Sequence[dict[str, Any]]) -> str:
    """Text table: one row per (method, budget), one column per data set, "mean ± std"."""
    sets = list(dict.fromkeys(r["dataset"] for r in records))
    rows = [["method", "budget", *sets]]
    keyed = {(r["method"], r["budget"], r["dataset"]): r for r in records}
    notes = {r["method"]: r["note"] for r in records if r.get("note")}
    options = {r["method"]: r["option"] for r in records}
    for method, budget in dict.fromkeys((r["method"], r["budget"]) for r in records):
        option = options[method]
        cells = []
        for s in sets:
            r = keyed.get((method, budget, s))
            if r is None:
                cells.append("-")
            elif r["status"] != "ok":
                cells.append(r["status"].split(":")[0])
            else:
                cells.append(f"{r['mean']:.3g} ± {r['std']:.2g}")
        rows.append([method + (" *" if method in notes else ""), f"{option}={budget}", *cells])
    return _text_table(rows) + (
        "\n* " + "; ".join(f"{m}: {n}" for m, n in notes.items()) if notes else "")


def kernel_table(records: Sequence[dict[str, Any]]) -> str:
    """Text table of the "features" sweep: MSE per m for each estimator and projection."""
    combos = [(e, p) for e in FEATURE_MAPS for p in ("orthogonal", "iid")]
    feats = sorted({r["m"] for r in records if r["sweep"] == "features"})
    keyed = {(r["estimator"], r["projection"], r["m"]): r for r in records
             if r["sweep"] == "features"}
    rows = [["m", *(f"{e} {p}" for e, p in combos), "positive iid theory"]]
    for m in feats:
        rows.append([str(m), *(f"{keyed[(e, p, m)]['mse']:.3g}" for e, p in combos),
                     f"{keyed[('positive', 'iid', m)]['mse_theory_iid']:.3g}"])
    return _text_table(rows)


def _text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
