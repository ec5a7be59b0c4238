"""Hybrid (Gated DeltaNet + attention) targets in the serving engine (serving/hybrid_step.py):
per-slot recurrent state, slots recycled while others run; every request passes token forcing
and free-running equals the decoder's AR, chains and trees; what is not built says so."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.serving import ServingEngine, ServingOptions
from specjax.trees.builders import TreeSpec
from test_serving import assert_forcing, random_prompts


@pytest.fixture(scope="module")
def hybrid():
    import jax
    from specjax.models.hybrid import init_random_hybrid_params
    from test_hybrid_decoding import hybrid_config
    cfg = hybrid_config(303)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(3))
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 5, 8, 2, 14)
    gen = GenerationConfig(max_new_tokens=14)
    return cfg, params, prompts, Decoder(cfg, params, gen).generate(prompts)


@pytest.mark.parametrize("mode", ["chain", "chain_device_loop", "tree"])
def test_hybrid_requests_pass_forcing(hybrid, mode):
    cfg, params, prompts, reference = hybrid
    opts = {"chain": ServingOptions(), "chain_device_loop": ServingOptions(steps_per_call=8),
            "tree": ServingOptions(tree=TreeSpec("topk", 5, 3), steps_per_call=4)}[mode]
    engine = ServingEngine(cfg, params, NgramDrafter(k=3, vocab_size=cfg.vocab_size), num_slots=2,
                           slot_len=48, page_size=8, options=opts, forcing=True)
    assert_forcing(engine, prompts, reference, 14)


def test_hybrid_free_running_equals_ar_with_slots_recycled(hybrid):
    cfg, params, prompts, reference = hybrid
    for drafter in (None, NgramDrafter(k=3, vocab_size=cfg.vocab_size)):
        engine = ServingEngine(cfg, params, drafter, num_slots=2, slot_len=48, page_size=8,
                               options=ServingOptions(steps_per_call=3))
        rids = [engine.submit(p, 14) for p in prompts]
        results = engine.run()
        assert [results[r].tokens for r in rids] == reference.tokens


def test_hybrid_mechanisms_not_built_say_so(hybrid):
    cfg, params, _, _ = hybrid
    d = NgramDrafter(k=3, vocab_size=cfg.vocab_size)
    for opts in (ServingOptions(budget=3), ServingOptions(packed=True), ServingOptions(two_level_k1=1)):
        with pytest.raises(NotImplementedError, match="hybrid targets in the serving engine"):
            ServingEngine(cfg, params, d, options=opts)
