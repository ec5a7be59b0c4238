"""Block and replay drafters as search mechanisms: registry spellings and features, the factory's
errors, one replay drafter serving every batch of its prompt set, and the search evaluator
measuring and gating both kinds on a random target (replayed figures labeled as such)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import shared_cpu_device_model, tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters import trained
from specjax.drafters.block import init_block_drafter
from specjax.drafters.factory import make_drafter
from specjax.drafters.replay import fit_profile, replay_drafter, save_profile
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.models.loading import LoadedModel
from specjax.search.evaluate import Evaluator
from specjax.search.evaluate import engine_changes
from specjax.search.registry import PILOT_K, REGISTRY, drafter_variant, pilot_k
from specjax.search.report import replayed

BLOCK = {"drafter.kind": "block", "drafter.k": 3, "drafter.block": "random", "drafter.block_layers": 2}
REPLAY = {"drafter.kind": "replay", "drafter.k": 3, "drafter.replay_profile": "smollm2-135m-block8",
          "drafter.block_layers": 1}


def test_registry_spells_and_features():
    assert drafter_variant(BLOCK) == "block:random:2"
    assert drafter_variant(dict(BLOCK, **{"drafter.block": "trained"})) == "block:trained:2"
    assert drafter_variant(REPLAY) == "replay:smollm2-135m-block8:1"
    f = REGISTRY.features(BLOCK)
    assert f["draft_kind"] == 3.0 and f["draft_layers"] == 2.0 and f["k"] == 3.0
    assert REGISTRY.features(REPLAY)["draft_kind"] == 4.0
    assert REGISTRY.apply(REPLAY) == {**REGISTRY.apply(REPLAY), "drafter": "replay:smollm2-135m-block8:1", "k": 3}
    assert replayed(REPLAY) and not replayed(BLOCK)
    # a trained block drafter fixes k, so its acceptance pilot runs at that k
    assert pilot_k(dict(BLOCK, **{"drafter.block": "trained", "drafter.k": 7})) == 7
    assert pilot_k(BLOCK) == pilot_k(REPLAY) == PILOT_K
    # trees: every drafter with distributions (not replay); a tree (nodes and builder) is its own
    # acceptance variant and an engine change
    tree = dict(BLOCK, **{"tree.nodes": 6})
    assert drafter_variant(tree) == "block:random:2+tree6" and REGISTRY.features(tree)["tree_nodes"] == 6.0
    assert engine_changes(tree)["tree"].shape.parents == (-1, 0, 1, 2, 0, 1, 2)
    assert REGISTRY.features(dict(REPLAY, **{"tree.nodes": 6}))["tree_nodes"] == 0.0
    assert engine_changes(BLOCK) == {}
    ngram = {"drafter.kind": "ngram", "drafter.k": 4, "tree.nodes": 16, "tree.builder": "topk"}
    assert drafter_variant(ngram) == "ngram:3+tree16:topk" and REGISTRY.features(ngram)["tree_nodes"] == 16.0
    spec = engine_changes(ngram)["tree"]
    assert (spec.builder, spec.nodes, spec.max_depth) == ("topk", 16, 4)
    from specjax.search.registry import TREE_BUILDERS
    from specjax.trees.builders import BUILDERS
    assert TREE_BUILDERS == BUILDERS  # the registry spells them without importing jax code
    best = dict(BLOCK, **{"tree.nodes": 2, "tree.builder": "best_first"})
    assert drafter_variant(best) == "block:random:2+tree2:best_first" and engine_changes(best)["tree"].max_depth == 2


def test_factory_errors_name_what_is_missing():
    cfg, params = tiny_model(seed=1)
    target = LoadedModel("tiny", cfg, params, None)
    with pytest.raises(ConfigError, match="no trained block drafter for 'tiny' at block size 4"):
        make_drafter("block", target, 3)
    with pytest.raises(ConfigError, match="replay:PROFILE:LAYERS"):
        make_drafter("replay:x", target, 3)
    with pytest.raises(ConfigError, match="known prompts"):
        make_drafter("replay:smollm2-135m-block8:1", target, 3)
    with pytest.raises(ConfigError, match="no recorded acceptance profile 'nope'"):
        make_drafter("replay:nope:1", target, 3, prompts=[[1, 2]], max_new_tokens=4)
    assert fit_profile([0.9, 0.5], 4) == [0.9, 0.5, 0.5, 0.5] and fit_profile([0.9, 0.5, 0.1], 2) == [0.9, 0.5]


def test_one_replay_drafter_serves_every_batch_of_its_prompt_set():
    """Rows find their own continuation by prompt, in any batch and order; a prompt outside the set
    gets only rejected drafts. The output is AR's either way."""
    cfg, params = tiny_model(seed=3, scale=0.4)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 5, 5, 7)]
    inner = init_block_drafter(params, cfg, jax.random.PRNGKey(0), 4, 1)
    drafter = replay_drafter(inner, cfg, params, prompts, 24, [1.0, 1.0, 1.0])
    gen = GenerationConfig(max_new_tokens=24)
    spec, ar = Decoder(cfg, params, gen, drafter), Decoder(cfg, params, gen)
    for batch in ([prompts[2], prompts[0]], [prompts[3]], [prompts[1], prompts[2], prompts[3]]):
        out = spec.generate(batch)
        assert out.tokens == ar.generate(batch).tokens
        assert out.tau == pytest.approx(4.0, abs=0.3)  # every draft accepted (bar the last round)
    stranger = [[int(t) for t in rng.integers(0, cfg.vocab_size, 4)]]
    out = spec.generate(stranger)
    assert out.tokens == ar.generate(stranger).tokens and out.tau == 1.0


@pytest.fixture(scope="module")
def evaluator():
    from specjax.models.config import ModelConfig
    from specjax.models.params import init_random_params
    cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    target = LoadedModel("random", cfg, init_random_params(cfg, jax.random.PRNGKey(0), scale=0.05), None)
    return Evaluator(target, [[1, 2, 3, 4, 1, 2], [7, 8, 9, 7]], 20, shared_cpu_device_model(), "cpu")


def test_evaluator_measures_and_gates_block_and_replay(evaluator, tmp_path, monkeypatch):
    monkeypatch.setattr(trained, "HERE", tmp_path)  # a recorded profile, as the trained drafters ship
    save_profile(tmp_path / "smollm2-135m-block8.profile.json", [0.9, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2],
                 {"target": "smollm2-135m", "drafter": "block8"})
    block = evaluator.gate(evaluator.measure(BLOCK, runs=1)[0])
    assert block.valid, block.rejected
    replay = evaluator.gate(evaluator.measure(REPLAY, runs=1)[0])
    assert replay.valid, replay.rejected
    assert replay.tau > 1.5 > block.tau  # borrowed acceptance on a target no drafter agrees with
    tree = evaluator.gate(evaluator.measure(dict(BLOCK, **{"tree.nodes": 6, "tree.builder": "best_first"}),
                                            runs=1)[0])
    assert tree.valid, tree.rejected  # measured and gated by token forcing over trees
