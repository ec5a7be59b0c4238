"""Sampled serving follows the target's distribution exactly, with the batching mechanisms on:
the first three tokens of 20,000 requests through the continuous-batching engine (chains, a
budgeted tree, a two-level tree) against the exact joint distribution (chi-square at fixed seeds, as tests/test_sampling_exactness.py)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_model
from specjax.serving import ServingEngine, ServingOptions
from specjax.trees.builders import TreeSpec
from test_sampling_exactness import PROMPT, SAMPLINGS, V, chi_square_p, exact_joint, hybrid_target, make

DRAWS = 20_000
CASES = {  # drafter, sampling, mechanisms (two-level draws its uniforms once per step)
    "ar": ("ar", "t1", ServingOptions(packed=True, steps_per_call=32)),
    "ngram_all": ("ngram", "t1", ServingOptions(budget=300, packed=True, steps_per_call=32, two_level_k1=1)),
    "small_two_level": ("small", "t08_p08", ServingOptions(steps_per_call=32, two_level_k1=2)),
    "block_budget": ("block", "t1", ServingOptions(budget=200, packed=True, steps_per_call=32)),
    "block_tree_budget": ("block", "t08_p08", ServingOptions(budget=300, packed=True, steps_per_call=32,
                                                            tree=TreeSpec("best_first", 6, 3))),
    "small_tree_two_level": ("small", "t1", ServingOptions(packed=True, steps_per_call=32, two_level_k1=2,
                                                           tree=TreeSpec("topk", 6, 3))),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=7, scale=0.15, vocab_size=V, hidden_size=16, intermediate_size=32,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)


def served_counts(engine) -> np.ndarray:
    """[V, V, V] counts of the first three tokens of DRAWS requests of PROMPT."""
    rids = [engine.submit(PROMPT, 3) for _ in range(DRAWS)]
    results = engine.run()
    first3 = np.array([results[r].tokens for r in rids])
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (first3[:, 0], first3[:, 1], first3[:, 2]), 1)
    return counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_served_tokens_follow_target(target, case):
    cfg, params = target
    kind, sampling_name, opts = CASES[case]
    sampling = SAMPLINGS[sampling_name]
    engine = ServingEngine(cfg, params, make(kind, cfg, params), num_slots=256, slot_len=16, page_size=4,
                           queue_len=256, max_waiting=DRAWS, prompt_width=len(PROMPT),
                           sampling=sampling, options=opts, seed=11)
    assert chi_square_p(served_counts(engine), exact_joint(cfg, params, sampling)) > 0.01


@pytest.mark.parametrize("tree,cut", [(None, None), (None, 100), ("topk", None)])
def test_served_hybrid_tokens_follow_target(tree, cut):
    """A hybrid target (GDN + attention) in the serving engine with the budget, packing and
    two-level verification (level 2 on level 1's K/V and GDN inputs; chains and top-k trees of
    an n-gram drafter); `cut`: level 2 verifies at most that many drafts over the batch
    (`two_level_tokens`, the best by survival score)."""
    from specjax.drafters.ngram import NgramDrafter
    cfg, params = hybrid_target()
    sampling = SAMPLINGS["t1" if tree is None else "t08_p08"]
    opts = ServingOptions(budget=400, packed=True, steps_per_call=32, two_level_k1=1, two_level_tokens=cut,
                          tree=None if tree is None else TreeSpec.budget(tree, 6, 3))
    engine = ServingEngine(cfg, params, NgramDrafter(k=3, vocab_size=V), num_slots=256, slot_len=16,
                           page_size=4, queue_len=256, max_waiting=DRAWS, prompt_width=len(PROMPT),
                           sampling=sampling, options=opts, seed=13)
    assert chi_square_p(served_counts(engine), exact_joint(cfg, params, sampling)) > 0.01
