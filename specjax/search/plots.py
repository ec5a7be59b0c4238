"""The search's plots, drawn from the results dict that `report.write_report` saves.

Three PNGs answer the three questions a reader of a search asks: did the search get closer to what
the cost model says is possible (speedup_per_round), which component it was fighting each round
(gap_breakdown), and whether the cost model's rankings can be trusted on this device
(predicted_vs_measured). `spearman` and `median_relative_error` are the two numbers behind the last
question; they are plain numpy so the benchmark can reuse them without matplotlib.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with tied values sharing the mean of the ranks they span (as scipy does)."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts + 1
    return (first + (counts - 1) / 2.0)[inverse]


def spearman(a, b) -> float:
    """Spearman's rank correlation (ties averaged); nan when there are fewer than two points or
    either side is constant, because a rank correlation is undefined there."""
    a, b = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if a.shape != b.shape:
        raise ValueError(f"spearman: lengths differ ({a.size} vs {b.size})")
    if a.size < 2:
        return float("nan")
    ra, rb = _average_ranks(a) - (a.size + 1) / 2.0, _average_ranks(b) - (b.size + 1) / 2.0
    denom = np.sqrt(np.sum(ra * ra) * np.sum(rb * rb))
    return float(np.sum(ra * rb) / denom) if denom > 0 else float("nan")


def median_relative_error(pred, meas) -> float:
    """Median of |pred - meas| / |meas|: the cost model's typical miss as a fraction of the truth;
    the median so that one pathological candidate does not dominate. nan when empty."""
    pred, meas = np.asarray(pred, dtype=float).ravel(), np.asarray(meas, dtype=float).ravel()
    if pred.shape != meas.shape:
        raise ValueError(f"median_relative_error: lengths differ ({pred.size} vs {meas.size})")
    if pred.size == 0:
        return float("nan")
    return float(np.median(np.abs(pred - meas) / np.abs(meas)))


def _number(x) -> float | None:
    """A finite float, or None for missing / None / nan values (rows from older results lack some)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")


def _plot_speedup(ax, results: dict, device: str) -> None:
    ar = _number(results.get("ar_tokens_per_s"))
    ar = ar if ar and ar > 0 else None
    rounds = results.get("rounds") or []
    xs, best, ceiling = [], [], []
    for r in rounds:
        inc = _number(r.get("incumbent_tokens_per_s"))
        speedup = _number(r.get("speedup"))
        if speedup is None and inc is not None and ar:
            speedup = inc / ar
        cap = _number(r.get("ceiling_tokens_per_s"))
        xs.append(r.get("round", len(xs)))
        best.append(np.nan if speedup is None else speedup)
        ceiling.append(cap / ar if cap is not None and ar else np.nan)
    if xs:
        ax.plot(xs, best, "o-", label="best measured (incumbent)")
        ax.plot(xs, ceiling, "s--", label="cost-model ceiling")
        ax.set_xticks(xs)
    else:
        _note(ax, "no rounds yet")
    stock = _number((results.get("stock") or {}).get("speedup"))
    if stock is not None:
        ax.axhline(stock, color="tab:green", linestyle=":", label=f"stock ({stock:.2f}x)")
    ax.axhline(1.0, color="gray", linewidth=0.8, label="AR (1.00x)")
    ax.set_xlabel("round")
    ax.set_ylabel("speedup over AR (x)")
    ax.set_title(f"Speedup per round (measured on {device})")
    ax.legend(loc="best", fontsize="small")


def _plot_gaps(ax, results: dict, device: str) -> None:
    rounds = results.get("rounds") or []
    components: list[str] = []
    for r in rounds:
        components += [c for c in (r.get("gaps_ms") or {}) if c not in components]
    if not components:
        _note(ax, "no rounds yet")
    xs = [r.get("round", i) for i, r in enumerate(rounds)]
    bottom = np.zeros(len(rounds))
    for c in components:
        heights = np.array([_number((r.get("gaps_ms") or {}).get(c)) or 0.0 for r in rounds])
        ax.bar(xs, heights, bottom=bottom, label=c)
        bottom += heights
    if components:
        ax.set_xticks(xs)
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("round")
    ax.set_ylabel("gap to the cost-model ideal (ms per step)")
    ax.set_title(f"Gap breakdown per round (cost model; search on {device})")


def _plot_predicted(ax, results: dict, device: str) -> None:
    pairs = []
    for row in results.get("evaluated") or []:
        p, m = _number(row.get("predicted_tokens_per_s")), _number(row.get("tokens_per_s"))
        if p is not None and m is not None and m > 0:
            pairs.append((p, m, row.get("rejected") is not None))
    title = f"Predicted vs measured (measured on {device})"
    if not pairs:
        _note(ax, "no measured rows with a prediction")
        ax.set_title(title)
    else:
        pred, meas, rejected = (np.array(v) for v in zip(*pairs))
        ok = ~rejected
        ax.scatter(pred[ok], meas[ok], marker="o", label="validated")
        if rejected.any():
            ax.scatter(pred[rejected], meas[rejected], marker="x", color="tab:red", label="rejected")
        lo, hi = min(pred.min(), meas.min()), max(pred.max(), meas.max())
        pad = 0.05 * (hi - lo) or 0.05 * hi
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="gray", linewidth=0.8, label="y = x")
        # the metrics use every row, rejected ones too: the gates judge output, not the speed predicted
        rho = spearman(pred, meas)
        rho_text = "n/a" if np.isnan(rho) else f"{rho:.2f}"
        ax.set_title(f"{title}\nmedian rel. error {median_relative_error(pred, meas):.1%}, "
                     f"Spearman rho {rho_text} (n={len(pairs)})")
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("cost-model predicted tok/s")
    ax.set_ylabel("measured tok/s")


def _save_atomic(fig, path: Path) -> None:
    """Save to a temp file next to `path`, then rename, so a viewer never sees half a PNG."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_plots(out_dir: Path, results: dict) -> list[Path]:
    """Write speedup_per_round.png, gap_breakdown.png and predicted_vs_measured.png into `out_dir`
    and return their paths. Missing rounds, rows or values give empty axes with a note, not an error,
    so a search that stopped early still gets its plots."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # no pyplot: no global figure state, safe off the main thread

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = results.get("measured_on") or "unknown device"
    written = []
    for name, draw in (("speedup_per_round.png", _plot_speedup), ("gap_breakdown.png", _plot_gaps),
                       ("predicted_vs_measured.png", _plot_predicted)):
        fig = Figure(figsize=(7, 4.5), layout="tight")
        draw(fig.add_subplot(), results, device)
        path = out_dir / name
        _save_atomic(fig, path)
        written.append(path)
    return written
