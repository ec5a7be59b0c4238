"""Budget selection and token layout (mechanisms 1 and 2) and page bookkeeping, on small arrays."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.serving.budget import admitted_drafts, choose_budget, layout
from specjax.serving.paged_cache import TRASH_PAGE, allocate, release


def test_budget_takes_best_survival_scores_as_prefixes():
    conf = jnp.asarray([[0.9, 0.9, 0.9], [0.5, 0.9, 0.9], [0.99, 0.1, 0.9], [1.0, 1.0, 1.0]])
    active = jnp.asarray([True, True, True, False])
    n = admitted_drafts(conf, active, budget=4)
    # scores: row0 .9 .81 .729; row1 .5 .45 .405; row2 .99 .099 .089; row3 inactive
    assert n.tolist() == [3, 0, 1, 0]
    assert admitted_drafts(conf, active, budget=None).tolist() == [3, 3, 3, 0]
    assert admitted_drafts(conf, active, budget=100).tolist() == [3, 3, 3, 0]


def test_ties_keep_prefixes():
    n = admitted_drafts(jnp.ones((3, 4)), jnp.ones(3, bool), budget=5)
    assert n.tolist() == [4, 1, 0]  # stable order: row 0's positions first, each row a prefix


def test_packed_layout_has_no_gaps_and_padded_has_fixed_strides():
    table = jnp.arange(12).reshape(3, 4) + 100
    first = jnp.asarray([10, 20, 30])
    counts = jnp.asarray([2, 0, 3])
    packed = layout(table, first, 0, 4, counts, True, 6)
    assert packed.valid.tolist() == [True] * 5 + [False]
    assert packed.tokens[:5].tolist() == [100, 101, 108, 109, 110]
    assert packed.positions[:5].tolist() == [10, 11, 30, 31, 32]
    assert packed.unpack[2, :3].tolist() == [2, 3, 4]
    padded = layout(table, first, 1, 3, counts, False, 0)
    assert padded.tokens.shape == (9,)
    assert padded.valid.tolist() == [True, True, False, False, False, False, True, True, True]
    assert padded.positions[6:].tolist() == [31, 32, 33]


def test_choose_budget_spends_drafts_where_they_pay():
    flat = lambda tokens: 1.0  # memory-bound: verify costs the same at any width -> all k drafts
    assert choose_budget(flat, [0.5] * 4, batch=8, k=4) == 32
    linear = lambda tokens: float(tokens)  # compute-bound: a draft pays only if alpha > 1 / ...
    assert choose_budget(linear, [0.1] * 4, batch=8, k=4) == 1  # none pays: the minimum
    assert choose_budget(lambda t: 1.0 + t / 64, [0.9, 0.9, 0.1, 0.1], batch=8, k=4) == 16


def test_pages_are_allocated_and_released_on_device():
    free = jnp.ones(8, bool).at[TRASH_PAGE].set(False)
    row, free = allocate(free, jnp.int32(3), 4)
    assert row.tolist() == [1, 2, 3, TRASH_PAGE] and free.tolist() == [False] * 4 + [True] * 4
    row2, free = allocate(free, jnp.int32(2), 4)
    assert row2.tolist() == [4, 5, TRASH_PAGE, TRASH_PAGE]
    free = release(free, jnp.stack([row, row2]), jnp.asarray([True, False]))
    assert np.nonzero(np.asarray(free))[0].tolist() == [1, 2, 3, 6, 7]


def test_verify_profile_measures_each_token_count():
    from conftest import tiny_model
    from specjax.serving.profile import interpolate, verify_profile
    cfg, params = tiny_model(seed=0, num_layers=1)
    prof = verify_profile(params, cfg, batch=2, slot_len=32, token_counts=[2, 8], page_size=8, reps=2)
    assert sorted(prof) == [2, 8] and all(t > 0 for t in prof.values())
    seconds = interpolate(prof)
    assert seconds(5) == pytest.approx((prof[2] + prof[8]) / 2)
    assert choose_budget(seconds, [0.9] * 3, batch=2, k=3) >= 1
