"""Batched admission (specjax/serving/admit_group.py): the requests admitted together are prefilled
in one forward, with the same slots, pages, first tokens and drafter rows as one-by-one admission,
including when the pages run out part-way through the group."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.block import init_block_drafter
from specjax.serving import ServingEngine, ServingOptions
from specjax.serving import step as step_mod
from specjax.serving.admit_group import GROUP
from specjax.serving.paged_cache import TRASH_PAGE
from specjax.serving.step import admit, take_inbox


def queued_state(engine, prompts, max_new):
    for p in prompts:
        engine.submit(p, max_new)
    return take_inbox(engine.state, engine._inbox(), jnp.full(4, -2, jnp.int32))


@pytest.mark.parametrize("num_pages,expect", [(None, 4), (1 + 12, 3)])
def test_batched_admission_equals_one_by_one(num_pages, expect):
    """5 queued requests, 4 free slots; with 12 free pages only 3 fit (4 + 3 + 4), and the group
    stops at the first request that does not fit, as one-at-a-time admission does. Every slot field, the pages, the
    free mask, the queue and the drafter rows match; the prompts' K/V match to float32 noise."""
    cfg, params = tiny_model(seed=4, num_layers=2)
    drafter = init_block_drafter(params, cfg, jax.random.PRNGKey(2), 4, 1, [0, 1], conv=True, scale=0.5)
    rng = np.random.default_rng(5)
    # pages needed (prompt + 8 new + k + 1 = 4 overshoot + 1, in pages of 8): 4, 3, 4, 4, 3
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (19, 5, 19, 19, 7)]
    engine = ServingEngine(cfg, params, drafter, num_slots=4, slot_len=32, page_size=8, queue_len=5,
                           prompt_width=20, num_pages=num_pages)
    st = queued_state(engine, prompts, 8)
    gen = GenerationConfig(max_new_tokens=32)
    run = jax.jit(lambda st, batched: admit(params, cfg, drafter, gen, False, st, drafter.k, batched),
                  static_argnums=1)
    one, grouped = run(st, False), run(st, True)
    assert int(jnp.sum(grouped.slots.busy)) == expect and int(grouped.queue.count) == 5 - expect
    for name in ("busy", "rid", "max_new", "pages", "failed"):
        np.testing.assert_array_equal(getattr(grouped.slots, name), getattr(one.slots, name), err_msg=name)
    for name in ("tokens", "length", "prompt_len", "done"):
        np.testing.assert_array_equal(getattr(grouped.slots.seqs, name), getattr(one.slots.seqs, name),
                                      err_msg=name)
    np.testing.assert_array_equal(grouped.free, one.free)
    for a, b in zip(jax.tree.leaves(grouped.queue), jax.tree.leaves(one.queue)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(grouped.dstate), jax.tree.leaves(one.dstate)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    used = np.unique(np.asarray(one.slots.pages))
    used = used[used != TRASH_PAGE]  # the trash page holds whatever padding tokens wrote
    for a, b in zip(grouped.cache.k + grouped.cache.v, one.cache.k + one.cache.v):
        np.testing.assert_allclose(np.asarray(a)[used], np.asarray(b)[used], rtol=1e-5, atol=1e-5)


def test_serving_with_batched_prefill_equals_one_by_one_and_runs_the_group(monkeypatch):
    """Free-running serving: the same tokens with batched prefill on and off, slots recycled
    mid-run (7 requests, 3 slots), and the group prefill compiled into the call."""
    cfg, params = tiny_model(seed=6, num_layers=2)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(2, 16))).tolist() for _ in range(7)]
    groups = {}
    real = step_mod.admit_group
    out = {}
    for batched in (False, True):
        def spy(*args, batched=batched):
            groups.setdefault(batched, set()).add(args[6])  # the static group size
            return real(*args)
        monkeypatch.setattr(step_mod, "admit_group", spy)
        from specjax.drafters.ngram import NgramDrafter
        engine = ServingEngine(cfg, params, NgramDrafter(k=3), num_slots=3, slot_len=48, page_size=8,
                               options=ServingOptions(packed=True, steps_per_call=4, batched_prefill=batched))
        rids = [engine.submit(p, 12) for p in prompts]
        res = engine.run()
        out[batched] = [res[r].tokens for r in rids]
    assert out[True] == out[False]
    # what each compiled call holds: one-at-a-time admission, and with batching the group forward
    assert groups == {False: {1}, True: {1, min(GROUP, 3)}}


def test_options_switch_is_static_and_defaults_on():
    assert ServingOptions().batched_prefill
    assert dataclasses.replace(ServingOptions(), batched_prefill=False) != ServingOptions()
