"""Token forcing for the serving engine: every request runs forced along its greedy AR reference
(the same judge as `specjax.forcing`, per request instead of per batch row)."""

from __future__ import annotations

import numpy as np

from specjax.forcing import ForcingReport, Mismatch


def check_serving_forcing(engine, prompts: list[list[int]], reference, max_new_tokens: int,
                          tolerance: float = 1e-3, submit_order=None) -> ForcingReport:
    """Submit every prompt (in `submit_order`, default as given) to `engine` (built with
    forcing=True) with its reference continuation (`reference`: a greedy AR GenerationResult),
    run to the end, and report every difference as the batch harness does."""
    order = range(len(prompts)) if submit_order is None else submit_order
    rids = {i: engine.submit(prompts[i], max_new_tokens, reference=reference.tokens[i]) for i in order}
    results = engine.run()
    failures, ties = [], []
    checked = expected = near = 0
    for i, rid in rids.items():
        res = results[rid]
        lo, hi = len(prompts[i]), len(prompts[i]) + len(reference.tokens[i])
        expected += hi - lo
        if res.status != "finished" or res.forced is None:
            failures.append(Mismatch(i, -1, -1, -1, float("nan")))
            continue
        f = res.forced
        checked += int(f["checked"][lo:hi].sum())
        margins = reference.margins[i]
        near += sum(m < tolerance for m in margins)
        for pos in np.nonzero(f["mismatch"][lo:hi])[0]:
            m = Mismatch(i, int(pos), int(f["engine_token"][lo + pos]), int(reference.tokens[i][pos]),
                         float(margins[pos]))
            (ties if m.margin < tolerance else failures).append(m)
    return ForcingReport(tolerance, checked, expected, near, failures, ties)
