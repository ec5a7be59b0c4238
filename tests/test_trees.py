"""Tree verification with static shapes (block drafters): shapes, masks, acceptance on hand-made
logits, and the engine token-exact against AR (greedy; sampled trees: tests/test_sampling_exactness.py;
builders and other drafters: tests/test_tree_builders.py) for chains, single nodes, all-sibling and
budgeted trees; an oracle drafter whose right tokens are only ever second choices proves that accepted side branches
are committed correctly (their K/V moved), not just that chains still work."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.block import init_block_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.models.kv_cache import read_rows
from specjax.trees.shape import TreeShape
from specjax.trees.tree import Tree
from specjax.trees.verify import greedy_tree_accept, tree_mask

# a spine of second choices: node 2 (rank 1) under the root, node 4 (rank 1) under it, node 6 under that
RANK1_SPINE = TreeShape((-1, 0, 0, 2, 2, 4, 4))


def test_shapes():
    t = TreeShape.for_budget(10, 4)
    assert t.num_nodes == 11 and t.max_depth == 4 and list(t.depths[:5]) == [0, 1, 2, 3, 4]
    assert list(RANK1_SPINE.ranks) == [0, 0, 1, 0, 1, 0, 1] and list(RANK1_SPINE.depths) == [0, 1, 1, 2, 2, 3, 3]
    assert RANK1_SPINE.ancestors[6].tolist() == [True, False, True, False, True, False, True]
    assert TreeShape.chain(3).parents == (-1, 0, 1, 2)
    with pytest.raises(ConfigError, match="parents"):
        TreeShape((-1, 2, 0))
    with pytest.raises(ConfigError, match="node"):
        TreeShape.for_budget(0, 3)


def test_mask_sees_prefix_and_ancestors_only():
    m = np.asarray(tree_mask(Tree.from_shape(RANK1_SPINE, jnp.zeros((1, 7), jnp.int32)), jnp.array([5]), 16))[0]
    assert m[:, :5].all() and not m[:, 12:].any()
    assert m[6, 5:12].tolist() == [True, False, True, False, True, False, True]
    assert m[3, 5:12].tolist() == [True, False, True, True, False, False, False]


def test_accept_takes_the_deepest_agreeing_path():
    V = 8
    tokens = jnp.array([[1, 2, 3, 4, 5, 6, 7]])
    choice = jnp.array([[3, 0, 5, 0, 7, 0, 2]])  # after root: 3 (node 2), after node 2: 5 (node 4), ...
    logits = jax.nn.one_hot(choice, V)
    tree = Tree.from_shape(RANK1_SPINE, tokens)
    n, path, out = greedy_tree_accept(tree, logits)
    assert int(n[0]) == 3 and path[0].tolist() == [0, 2, 4, 6] and out[0].tolist() == [3, 5, 7, 2]
    n, path, out = greedy_tree_accept(tree, jax.nn.one_hot(jnp.zeros((1, 7), int), V))
    assert int(n[0]) == 0 and out[0, 0] == 0  # nothing agrees: the target's own token only


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_is_exact_for_every_tree_shape(seed):
    cfg, params = tiny_model(seed=seed, scale=0.3)
    drafter = init_block_drafter(params, cfg, jax.random.PRNGKey(seed), 6, 1)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (3, 7)]
    gen = GenerationConfig(max_new_tokens=24)
    ar = Decoder(cfg, params, gen).generate(prompts).tokens
    shapes = [TreeShape.chain(5), TreeShape((-1,)), TreeShape((-1, 0)), TreeShape((-1,) + (0,) * 8),
              TreeShape.for_budget(16, 5), TreeShape.for_budget(63, 5)]
    for shape in shapes:
        assert Decoder(cfg, params, gen, drafter, tree=shape).generate(prompts).tokens == ar, shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SecondChoiceOracle:
    """Knows the AR continuation and always ranks it second (a decoy first)."""
    refs: jax.Array  # [B, R]
    vocab_size: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))

    def init(self, prompt, prompt_len, num_slots):
        return ()

    def block_logits(self, state, seqs):
        ref = read_rows(self.refs, seqs.length, self.k)
        return jax.nn.one_hot((ref + 1) % self.vocab_size, self.vocab_size) * 2 + jax.nn.one_hot(ref, self.vocab_size)

    def propose(self, state, seqs, key, sampling):  # as a chain drafter: the decoys
        return jnp.argmax(self.block_logits(state, seqs), -1).astype(jnp.int32), None, state


def test_side_branches_are_accepted_and_committed():
    cfg, params = tiny_model(seed=5, scale=0.3)
    prompts = [[5, 9, 2], [7, 7, 1, 3, 8]]
    gen = GenerationConfig(max_new_tokens=30)
    ar = Decoder(cfg, params, gen).generate(prompts).tokens
    refs = np.zeros((2, 128), np.int32)
    for i, (p, t) in enumerate(zip(prompts, ar)):
        refs[i, :len(p) + len(t)] = p + t
    oracle = SecondChoiceOracle(jnp.asarray(refs), cfg.vocab_size, 3)
    tree = Decoder(cfg, params, gen, oracle, tree=RANK1_SPINE).generate(prompts)
    assert tree.tokens == ar
    assert tree.tau > 3.5  # 3 drafts per round on the spine of second choices (+ the target's token)
    assert Decoder(cfg, params, gen, oracle).generate(prompts).tau == 1.0  # a chain takes the decoys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChainOnly:
    """A drafter with drafts but no distributions (as acceptance replay)."""
    k: int = dataclasses.field(metadata=dict(static=True))

    def init(self, prompt, prompt_len, num_slots):
        return ()

    def propose(self, state, seqs, key, sampling):
        return jnp.broadcast_to(seqs.pending()[:, None], (seqs.length.shape[0], self.k)), None, state


def test_unsupported_combinations_are_refused():
    cfg, params = tiny_model(seed=1)
    block = init_block_drafter(params, cfg, jax.random.PRNGKey(0), 4, 1)
    gen = GenerationConfig(max_new_tokens=4)
    with pytest.raises(NotImplementedError, match="per-position"):
        Decoder(cfg, params, gen, ChainOnly(k=3), tree=TreeShape.chain(2))
    with pytest.raises(ValueError, match="vocab_size"):
        Decoder(cfg, params, gen, NgramDrafter(k=3), tree=TreeShape.chain(2))
    with pytest.raises(ValueError, match="depth 5"):
        Decoder(cfg, params, gen, block, tree=TreeShape.chain(5))


def test_cli_tree_with_the_shipped_drafter(capsys, tmp_path):
    """`specjax generate --drafter block --tree 12` (best-first), `--drafter ngram --tree 6` (top-k)
    and `--tree-shape FILE.yaml` (static) on SmolLM2: tokens identical to AR; a tree without a
    drafter and a bad shape file are refused with one line naming the problem."""
    from specjax.cli import main
    assert main(["generate", "--drafter", "block", "--tree", "12", "--humaneval", "1",
                 "--max-new-tokens", "16", "--compare-ar"]) == 0
    assert "tokens identical to AR" in capsys.readouterr().out
    assert main(["generate", "--drafter", "ngram", "--tree", "6", "--humaneval", "1",
                 "--max-new-tokens", "12", "--compare-ar"]) == 0
    assert "tokens identical to AR" in capsys.readouterr().out
    shape = tmp_path / "tree.yaml"
    shape.write_text("parents: [-1, 0, 0, 1, 1, 3]\n")
    assert main(["generate", "--drafter", "ngram", "--tree-shape", str(shape), "--humaneval", "1",
                 "--max-new-tokens", "12", "--compare-ar"]) == 0
    assert "tokens identical to AR" in capsys.readouterr().out
    shape.write_text("parents: [-1, 0, 5]\n")
    assert main(["generate", "--drafter", "ngram", "--tree-shape", str(shape), "--prompt", "hi"]) == 2
    assert f"{shape}: parents:" in capsys.readouterr().err
    assert main(["generate", "--drafter", "none", "--tree", "4", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "need a drafter" in capsys.readouterr().err


def test_token_forcing_passes_trees_and_catches_a_broken_one(monkeypatch):
    """The forcing harness (forcing.py) over trees: zero failures on random block drafters and the
    oracle; a tree rule that commits the drafted path without checking it is caught."""
    import specjax.decoding.tree as tree_module
    from specjax.forcing import check_token_forcing
    from specjax.trees import verify
    cfg, params = tiny_model(seed=8, scale=0.3)
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, n)] for n in (4, 9)]
    gen = GenerationConfig(max_new_tokens=20)
    ref = Decoder(cfg, params, gen).generate(prompts)
    drafter = init_block_drafter(params, cfg, jax.random.PRNGKey(1), 5, 1)
    for shape in (TreeShape.for_budget(12, 4), TreeShape((-1, 0, 0, 0))):
        report = check_token_forcing(Decoder(cfg, params, gen, drafter, tree=shape), prompts, ref, tolerance=0.0)
        assert report.passed and report.checked > 0, report.summary()

    def trusting(tree, logits):  # accepts the whole chain unchecked
        n, path, out = verify.greedy_tree_accept(tree, logits)
        full = jnp.full_like(n, tree.max_depth)
        out = jnp.concatenate([tree.tokens[:, 1:], out[:, -1:]], axis=1)
        return full, jnp.broadcast_to(jnp.arange(tree.num_nodes), path.shape), out
    monkeypatch.setattr(tree_module, "greedy_tree_accept", trusting)
    jax.clear_caches()
    try:
        report = check_token_forcing(Decoder(cfg, params, gen, drafter, tree=TreeShape.chain(4)), prompts, ref,
                                     tolerance=0.0)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert not report.passed
