"""Search plots and live progress: valid PNGs from realistic and empty results, the rank/error
helpers against hand-computed values and scipy, and both progress displays."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from scipy.stats import spearmanr

from specjax.search.plots import median_relative_error, spearman, write_plots
from specjax.search.progress import LiveProgress

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMES = ["speedup_per_round.png", "gap_breakdown.png", "predicted_vs_measured.png"]


def results(rounds: int = 3, rows: bool = True) -> dict:
    ar = 100.0
    history = [{"round": r, "directions": ["verify"], "screened": 4, "incumbent": {"drafter.k": 4 + r},
                "incumbent_tokens_per_s": 130.0 + 10 * r, "speedup": (130.0 + 10 * r) / ar,
                "predicted_tokens_per_s": 140.0 + 10 * r, "ceiling_tokens_per_s": 200.0 - 5 * r,
                "gaps_ms": {"verify": 2.0 - 0.5 * r, "draft": 1.0, "commit": 0.2}} for r in range(rounds)]
    evaluated = [
        {"config": {"drafter.k": 4}, "round": 0, "tokens_per_s": 130.0, "predicted_tokens_per_s": 140.0},
        {"config": {"drafter.k": 5}, "round": 0, "tokens_per_s": 140.0, "predicted_tokens_per_s": 150.0},
        {"config": {"drafter.k": 6}, "round": 1, "tokens_per_s": 150.0, "predicted_tokens_per_s": 155.0},
        {"config": {"drafter.k": 7}, "round": 1, "tokens_per_s": 90.0, "predicted_tokens_per_s": 160.0,
         "rejected": "token-forcing gate: output differs from AR"},
        {"config": {"drafter.k": 8}, "round": 2, "tokens_per_s": 120.0, "predicted_tokens_per_s": None},
        {"config": {"drafter.k": 9}, "round": 2, "tokens_per_s": 145.0},  # older row: no prediction key
    ]
    for row in evaluated:
        row.setdefault("rejected", None)
        row.update(speedup=row["tokens_per_s"] / ar, tau=2.5, device="NVIDIA H200")
    return {"ar_tokens_per_s": ar, "measured_on": "NVIDIA H200",
            "stock": {"config": {"drafter.k": 4}, "tokens_per_s": 125.0, "speedup": 1.25, "rejected": None},
            "found": {"config": {"drafter.k": 6}, "tokens_per_s": 150.0, "speedup": 1.5},
            "rounds": history, "evaluated": evaluated if rows else []}


def assert_pngs(out, paths):
    assert [p.name for p in paths] == NAMES
    for p in paths:
        assert p.parent == out and p.stat().st_size > 1000
        assert p.read_bytes()[:8] == PNG_MAGIC
    assert sorted(x.name for x in out.iterdir()) == sorted(NAMES)  # no temp files left behind


def test_write_plots_realistic(tmp_path):
    assert_pngs(tmp_path, write_plots(tmp_path, results()))


def test_write_plots_empty(tmp_path):
    assert_pngs(tmp_path, write_plots(tmp_path, results(rounds=0, rows=False)))
    bare = tmp_path / "bare"
    assert_pngs(bare, write_plots(bare, {}))


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 25, 100]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    a, b = [1, 2, 2, 3, 5, 5, 5], [3, 1, 4, 4, 2, 9, 6]
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 40), rng.integers(0, 5, 40)
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)
    assert np.isnan(spearman([1.0], [2.0])) and np.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_median_relative_error():
    # |110-100|/100 = 0.10, |180-200|/200 = 0.10, |150-100|/100 = 0.50, |95-100|/100 = 0.05 -> median 0.10
    assert median_relative_error([110, 180, 150, 95], [100, 200, 100, 100]) == pytest.approx(0.10)
    # errors 0.5, 0.25 -> median 0.375
    assert median_relative_error([150, 75], [100, 100]) == pytest.approx(0.375)
    assert np.isnan(median_relative_error([], []))


SUMMARY = {"round": 2, "rounds": 6, "measurements": 11, "incumbent": {"drafter.k": 6}, "speedup": 1.3372,
           "best_predicted": 161.5, "elapsed_s": 42.7, "phase": "measuring"}


def test_progress_plain():
    out = io.StringIO()
    with LiveProgress(stream=out) as progress:  # a StringIO is not a TTY: plain lines
        progress("measuring plain AR [baseline]")
        progress.status(SUMMARY)
    assert out.getvalue().splitlines() == ["measuring plain AR [baseline]",
                                           "[round 2/6 | 11 measured | 1.34x AR | 42s] measuring"]


def test_progress_rich():
    from rich.console import Console
    buf = io.StringIO()
    with LiveProgress(console=Console(file=buf, force_terminal=True, width=100)) as progress:
        progress("round 2: incumbent {'drafter.k': 6} [bold]not markup[/bold]")
        progress.status(SUMMARY)
        progress.status({**SUMMARY, "measurements": 12, "phase": "screening"})
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "[bold]not markup[/bold]" in text
    for value in ("1.34x AR", "2/6", "12", "42s", "161.50", "screening", '{"drafter.k": 6}'):
        assert value in text
