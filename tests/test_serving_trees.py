"""Tree verification in the serving engine (specjax/serving/tree_step.py): every request passes
token forcing and free-running equals AR, with trees under each batching mechanism that supports
them (budget, packed, device-resident steps), block and AR drafters, requests arriving and leaving
at any step; the configurations it does not support say so."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.serving import ServingEngine, ServingOptions
from specjax.trees.builders import TreeSpec
from specjax.trees.shape import TreeShape
from test_serving import assert_forcing, make_drafter, random_prompts

TREES = {"topk": TreeSpec("topk", 6, 3), "best_first": TreeSpec("best_first", 7, 3),
         "static": TreeShape.for_budget(6, 3)}
MECHANISMS = {
    "stock": {},
    "budget": dict(budget=5),
    "packed": dict(packed=True),
    "two_level": dict(two_level_k1=2),
    "two_level_packed": dict(two_level_k1=3, packed=True, budget=8),
    "all": dict(budget=7, packed=True, steps_per_call=8, two_level_k1=2),
    "paged_kernel": dict(packed=True, two_level_k1=2, attention="interpret"),
}


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_model(seed=1)
    rng = np.random.default_rng(2)
    prompts = random_prompts(rng, 6, 8)
    gen = GenerationConfig(max_new_tokens=18)
    return cfg, params, prompts, Decoder(cfg, params, gen).generate(prompts)


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_trees_under_each_mechanism_pass_forcing(tiny, mechanism):
    cfg, params, prompts, reference = tiny
    drafter = NgramDrafter(k=4, vocab_size=cfg.vocab_size)
    opts = ServingOptions(tree=TREES["topk"], **MECHANISMS[mechanism])
    engine = ServingEngine(cfg, params, drafter, num_slots=3, slot_len=64, page_size=16 if "kernel" in mechanism else 8,
                           options=opts, forcing=True)
    assert_forcing(engine, prompts, reference, 18)


@pytest.mark.parametrize("kind,tree", [("block", "best_first"), ("small", "topk"), ("ngram", "static")])
def test_free_running_trees_equal_ar(kind, tree):
    """No forcing: each request's own output equals AR's; more requests than slots, so slots are
    recycled while others are mid-tree."""
    cfg, params = tiny_model(seed=3, num_layers=2)
    rng = np.random.default_rng(4)
    prompts = random_prompts(rng, 5, 10)
    gen = GenerationConfig(max_new_tokens=16)
    ar = Decoder(cfg, params, gen).generate(prompts).tokens
    drafter = make_drafter(kind, cfg, params, 4)
    if kind == "ngram":
        drafter = NgramDrafter(k=4, vocab_size=cfg.vocab_size)
    engine = ServingEngine(cfg, params, drafter, num_slots=2, slot_len=64, page_size=8,
                           options=ServingOptions(tree=TREES[tree], packed=True))
    rids = [engine.submit(p, 16) for p in prompts]
    results = engine.run()
    assert [results[r].tokens for r in rids] == ar
    assert sum(results[r].committed for r in rids) > sum(results[r].rounds for r in rids)  # trees paid


def test_tree_configurations_not_built_say_so(tiny):
    cfg, params, _, _ = tiny
    drafter = NgramDrafter(k=4, vocab_size=cfg.vocab_size)
    with pytest.raises(ConfigError, match="two_level_tokens cannot cut a tree"):
        ServingEngine(cfg, params, drafter, options=ServingOptions(tree=TREES["topk"], two_level_k1=2,
                                                                    packed=True, two_level_tokens=2))
    with pytest.raises(ConfigError, match=r"two_level_k1 must be in \[1, tree nodes\)"):
        ServingEngine(cfg, params, drafter, options=ServingOptions(tree=TREES["topk"], two_level_k1=6))
    with pytest.raises(ConfigError, match="at most 64 nodes"):
        ServingEngine(cfg, params, NgramDrafter(k=8, vocab_size=cfg.vocab_size), page_size=16,
                      options=ServingOptions(tree=TreeSpec("topk", 64, 8), attention="interpret"))
    with pytest.raises(ConfigError, match="needs a drafter"):
        ServingEngine(cfg, params, None, options=ServingOptions(tree=TREES["topk"]))
    with pytest.raises(ValueError, match="exceeds the drafter"):
        ServingEngine(cfg, params, NgramDrafter(k=2, vocab_size=cfg.vocab_size),
                      options=ServingOptions(tree=TREES["topk"]))


def test_the_search_sends_trees_with_batching_to_the_serving_engine():
    from specjax.search.registry import REGISTRY
    config = {"drafter.kind": "ngram", "drafter.k": 4, "tree.nodes": 6, "tree.builder": "topk",
              "serving.packed": "on", "serving.two_level_k1": 2, "serving.attention": "kernel"}
    opts = REGISTRY.apply(config)["serving"]
    assert opts.tree == TreeSpec("topk", 6, 4) and opts.packed
    assert opts.two_level_k1 == 2 and opts.attention == "xla"  # the kernel on GPUs only
    assert REGISTRY.apply(dict(config, **{"serving.packed": "off", "serving.two_level_k1": 0}))["serving"] is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_two_level_trees_give_the_one_level_step_token_for_token(temperature):
    """Level 1's walk is the true walk until it first steps onto a level-2 node, and the second
    walk repeats it with the same key: with the same seed, two-level trees serve exactly the
    tokens one-level trees do, sampled as well as greedy (docs/design/serving_trees.md)."""
    from specjax.sampling import SamplingConfig
    cfg, params = tiny_model(seed=5, num_layers=2)
    rng = np.random.default_rng(6)
    prompts = random_prompts(rng, 5, 9)
    from specjax.drafters.model_drafter import small_model_drafter
    drafter = small_model_drafter(params, cfg, cfg, 4)  # the target itself: long accepted paths
    served = []
    for k1 in (None, 1, 3):
        engine = ServingEngine(cfg, params, drafter, num_slots=3, slot_len=64, page_size=8, seed=3,
                               sampling=SamplingConfig(temperature=temperature),
                               options=ServingOptions(tree=TREES["best_first"], packed=True, two_level_k1=k1))
        rids = [engine.submit(p, 14) for p in prompts]
        results = engine.run()
        served.append([(results[r].tokens, results[r].committed, results[r].rounds) for r in rids])
    assert served[1] == served[0] and served[2] == served[0]
    # level 2 ran: with k1 = 1 a step commits at most 2 tokens from level 1 alone
    assert sum(c for _, c, _ in served[1]) > 2 * sum(r for _, _, r in served[1])
