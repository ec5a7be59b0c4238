"""Tree builders and per-row tree verification.

- Per-row trees: ancestors, depths and masks from parents inside jit; the greedy rule against a
  plain walk; the sampled rule keeps the target's distribution at every node it reaches (and a rule
  that forgets rejected candidates is caught), repeated sibling tokens included.
- Builders: parents point earlier, N nodes, depth <= D, distinct sibling tokens; best-first is a
  top path-probability set and top-k the chain plus its likeliest alternatives (brute force).
- Drafters: the model drafter's cache is valid after a tree accepts a path off its chain.
- Engine: token forcing with zero failures, and greedy output equal to AR, for block, layer-skip
  and n-gram drafters with every builder, trees of 1 and 64 nodes and degenerate shapes, on a
  random tiny fp32 config drawn from a fresh seed (SPECJAX_TREE_SEED=... reproduces one).
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.decoding.sequences import GenerationConfig, Sequences, commit
from specjax.drafters.block import init_block_drafter
from specjax.drafters.model_drafter import layer_skip_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.forcing import check_token_forcing
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.params import init_random_params
from specjax.errors import ConfigError
from specjax.sampling import SamplingConfig, sample_from
from specjax.trees.builders import TreeSpec, best_first_tree, log_probs, static_tree, topk_tree
from specjax.trees.shape import TreeShape
from specjax.trees.tree import Tree
from specjax.trees.verify import greedy_tree_accept, sampled_tree_accept, tree_mask

SEED = int(os.environ.get("SPECJAX_TREE_SEED", np.random.SeedSequence().entropy % 2**31))


def random_parents(rng, n):
    return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]


def check_tree(tree: Tree, num_nodes: int | None = None):
    """Every builder's invariants; returns (parents, tokens, depths) as numpy."""
    parents, tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    depths = np.asarray(tree.depths())
    B, N = parents.shape
    assert num_nodes is None or N == num_nodes + 1
    assert (parents[:, 0] == -1).all() and (parents < np.arange(N)).all() and (parents >= -1).all()
    assert depths.max() <= tree.max_depth
    for b in range(B):
        for i in range(1, N):
            if parents[b, i] >= 0:
                assert depths[b, i] == depths[b, parents[b, i]] + 1
        for p in set(parents[b, 1:].tolist()) - {-1}:
            kids = tokens[b, 1:][parents[b, 1:] == p]
            assert len(set(kids.tolist())) == len(kids), f"row {b}: node {p} repeats child tokens {kids}"
    return parents, tokens, depths


def path_scores(tree: Tree, logp: np.ndarray) -> np.ndarray:
    """[B, N] sum of the draft log-probabilities along each node's path (-inf for padding)."""
    parents, tokens, depths = (np.asarray(a) for a in (tree.parents, tree.tokens, tree.depths()))
    score = np.zeros(parents.shape)
    for b, i in itertools.product(range(parents.shape[0]), range(1, parents.shape[1])):
        p = parents[b, i]
        score[b, i] = -np.inf if p < 0 else score[b, p] + logp[b, depths[b, i] - 1, tokens[b, i]]
    return score


# ----------------------------------------------------------------------------- per-row trees


def test_tree_arrays_follow_per_row_parents():
    rng = np.random.default_rng(SEED)
    shapes = [TreeShape(tuple(random_parents(rng, 12))) for _ in range(3)] + [TreeShape.chain(11)]
    tree = Tree(jnp.zeros((4, 12), jnp.int32), jnp.asarray([s.parents for s in shapes], jnp.int32),
                max(s.max_depth for s in shapes))
    anc = np.asarray(tree.ancestors())
    for b, s in enumerate(shapes):
        assert (anc[b] == s.ancestors).all() and (np.asarray(tree.depths())[b] == s.depths).all(), SEED
    start = jnp.array([0, 3, 5, 9])
    mask = np.asarray(tree_mask(tree, start, 32))
    for b, s in enumerate(shapes):
        st = int(start[b])
        assert mask[b, :, :st].all() and not mask[b, :, st + 12:].any()
        assert (mask[b, :, st:st + 12] == s.ancestors).all()


def greedy_walk(parents, tokens, choice):
    """The greedy rule spelled out: the deepest node whose path agrees with the target (lowest index
    on a tie) -> (path, out)."""
    n = len(parents)
    ok = [True] + [False] * (n - 1)
    depth = [0] * n
    for i in range(1, n):
        if parents[i] >= 0:
            ok[i] = ok[parents[i]] and tokens[i] == choice[parents[i]]
            depth[i] = depth[parents[i]] + 1
    end = max((i for i in range(n) if ok[i]), key=lambda i: (depth[i], -i))
    path = [end]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    path = path[::-1]
    return path, [tokens[i] for i in path[1:]] + [choice[end]]


def test_greedy_accept_matches_a_plain_walk_on_per_row_trees():
    rng = np.random.default_rng(SEED)
    B, N, V = 16, 20, 4
    parents = np.array([random_parents(rng, N) for _ in range(B)])
    parents[:, -3:] = -1  # padding nodes: never accepted
    logits = rng.normal(size=(B, N, V)).astype(np.float32)
    choice = logits.argmax(-1)
    # half the nodes hold the target's choice after their parent, so long paths get accepted
    tokens = np.where(rng.random((B, N)) < 0.5, np.take_along_axis(choice, np.maximum(parents, 0), 1),
                      rng.integers(0, V, (B, N)))
    tree = Tree(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), N - 1)
    n, path, out = (np.asarray(a) for a in greedy_tree_accept(tree, jnp.asarray(logits)))
    for b in range(B):
        want_path, want_out = greedy_walk(parents[b].tolist(), tokens[b].tolist(), choice[b].tolist())
        assert n[b] == len(want_path) - 1, SEED
        assert path[b, :n[b] + 1].tolist() == want_path and out[b, :n[b] + 1].tolist() == want_out, SEED


def node_laws_p_values(parents, tokens, probs, rule, draws=200_000, min_visits=3000, seed=0):
    """Run `rule` on one tree replicated over `draws` rows; for every node reached at least
    `min_visits` times, the chi-square p-value of the token emitted right after it against the
    target's distribution there (exactness: the next token after any reached node follows p)."""
    N, V = probs.shape
    depth = [0] * N
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1 if parents[i] >= 0 else 0
    tree = Tree(jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (draws, N)),
                jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (draws, N)), max(depth))
    n, path, out = (np.asarray(a) for a in jax.jit(rule)(
        tree, jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (draws, N, V)), jax.random.PRNGKey(seed)))
    p_values = {}
    for u in range(N):
        d = depth[u]
        reached = (n >= d) & (path[:, d] == u) if (u == 0 or parents[u] >= 0) else np.zeros(draws, bool)
        if reached.sum() < min_visits:
            continue
        counts = np.bincount(out[reached, d], minlength=V)
        expected = probs[u] * reached.sum()
        assert counts[expected == 0].sum() == 0, f"node {u}: drew a token of probability 0"
        p_values[u] = stats.chisquare(counts[expected > 0], expected[expected > 0]).pvalue
    return p_values


def forgetful_rule(tree, probs, key):
    """Wrong on purpose: after the walk stops, draw from p without removing rejected candidates."""
    n, path, out = sampled_tree_accept(tree, probs, key)
    rows = jnp.arange(tree.tokens.shape[0])
    last = jnp.take_along_axis(path, n[:, None], axis=1)[:, 0]
    return n, path, out.at[rows, n].set(sample_from(probs[rows, last], jax.random.fold_in(key, 1)))


@pytest.mark.parametrize("tree_kind", ["budget", "repeated_siblings_and_padding"])
def test_sampled_accept_keeps_the_target_law_at_every_reached_node(tree_kind):
    rng = np.random.default_rng(3)
    V = 5
    if tree_kind == "budget":  # distinct tokens under each node: ranks of a per-depth permutation
        shape = TreeShape.for_budget(9, 3)
        perms = [rng.permutation(V) for _ in range(4)]
        parents = list(shape.parents)
        tokens = [int(perms[d][r]) for d, r in zip(shape.depths, shape.ranks)]
    else:  # siblings 1 and 2 repeat a token; node 6 is padding
        parents = [-1, 0, 0, 0, 1, 1, -1, 4]
        tokens = [0, 2, 2, 4, 1, 3, 0, 2]
    probs = rng.dirichlet(np.ones(V) * 0.7, size=len(parents))
    probs[0] = probs[1] = [0.15, 0.3, 0.3, 0.1, 0.15]  # the walk goes deep often enough to test it
    p_values = node_laws_p_values(parents, tokens, probs, sampled_tree_accept)
    assert len(p_values) >= 3 and min(p_values.values()) > 1e-3, p_values
    broken = node_laws_p_values(parents, tokens, probs, forgetful_rule)
    assert min(broken.values()) < 1e-6, broken


# ----------------------------------------------------------------------------- builders


def all_paths(logp_row, depth):
    """Every path of at most `depth` tokens, with its score."""
    D, V = logp_row.shape
    for d in range(1, depth + 1):
        for path in itertools.product(range(V), repeat=d):
            yield path, sum(logp_row[e, path[e]] for e in range(d))


@pytest.mark.parametrize("num_nodes,depth,vocab", [(1, 3, 5), (7, 3, 5), (30, 3, 4), (40, 2, 3), (12, 4, 2)])
def test_best_first_takes_the_top_path_probability_set(num_nodes, depth, vocab):
    """Brute force over every path; (40, 2, 3) has 12 paths for 40 nodes: the rest is padding."""
    rng = np.random.default_rng([SEED, num_nodes])
    logits = jnp.asarray(rng.normal(size=(3, depth + 1, vocab)) * 2.5, jnp.float32)
    pending = jnp.array([1, 0, 1])
    tree = jax.jit(best_first_tree, static_argnums=(2, 3))(pending, logits, num_nodes, depth)
    parents, tokens, _ = check_tree(tree, num_nodes)
    assert (tokens[:, 0] == np.asarray(pending)).all()
    logp = np.asarray(log_probs(logits))
    scores = path_scores(tree, logp)
    for b in range(3):
        every = sorted((s for _, s in all_paths(logp[b], depth)), reverse=True)
        got = sorted(scores[b, 1:][parents[b, 1:] >= 0], reverse=True)
        assert len(got) == min(num_nodes, len(every)), SEED
        np.testing.assert_allclose(got, every[:len(got)], atol=1e-4, err_msg=f"seed {SEED}")


@pytest.mark.parametrize("num_nodes,depth", [(1, 4), (4, 4), (11, 4), (20, 3)])
def test_topk_is_the_chain_plus_its_likeliest_alternatives(num_nodes, depth):
    rng = np.random.default_rng([SEED, num_nodes, 1])
    V = 6
    logits = jnp.asarray(rng.normal(size=(2, depth, V)) * 2, jnp.float32)
    chain = jnp.asarray(rng.integers(0, V, (2, depth)), jnp.int32)  # an AR drafter's own chain
    tree = jax.jit(topk_tree, static_argnums=(2, 3))(jnp.array([3, 4]), logits, num_nodes, depth, chain)
    parents, tokens, depths = check_tree(tree, num_nodes)
    logp = np.asarray(log_probs(logits))
    scores = path_scores(tree, logp)
    spine = min(num_nodes, depth)
    for b in range(2):
        assert parents[b, 1:spine + 1].tolist() == list(range(spine)), SEED  # the chain comes first
        assert tokens[b, 1:spine + 1].tolist() == np.asarray(chain)[b, :spine].tolist()
        assert (parents[b, spine + 1:] < spine).all()  # alternatives hang off chain nodes (or pad)
        # alternatives: the best among every other child of a chain node
        prefix = np.concatenate([[0.0], np.cumsum([logp[b, d, chain[b, d]] for d in range(depth)])])
        alt = sorted((prefix[d] + logp[b, d, v] for d in range(spine) for v in range(V)
                      if v != chain[b, d]), reverse=True)
        got = sorted(scores[b, spine + 1:][parents[b, spine + 1:] >= 0], reverse=True)
        assert len(got) == min(num_nodes - spine, len(alt))
        np.testing.assert_allclose(got, alt[:len(got)], atol=1e-4, err_msg=f"seed {SEED}")


def test_static_tree_ranks_and_the_chain_spine():
    rng = np.random.default_rng(SEED)
    logits = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
    shape = TreeShape.for_budget(7, 3)
    tree = static_tree(shape, jnp.array([5, 6]), logits)
    _, tokens, _ = check_tree(tree, 7)
    top = np.argsort(-np.asarray(logits), axis=-1)
    assert (tokens[:, 1:] == top[:, shape.depths[1:] - 1, shape.ranks[1:]]).all()
    chain = jnp.array([[7, 7, 7], [0, 1, 2]])
    spine = np.asarray(static_tree(TreeShape.chain(3), jnp.array([5, 6]), logits, chain).tokens)
    assert spine[:, 1:].tolist() == [[7, 7, 7], [0, 1, 2]]
    with pytest.raises(ConfigError, match="siblings"):
        static_tree(TreeShape((-1,) + (0,) * 9), jnp.array([5, 6]), logits)


def test_builders_jit_with_static_sizes():
    build = jax.jit(best_first_tree, static_argnums=(2, 3))
    logits = jnp.asarray(np.random.default_rng(SEED).normal(size=(2, 5, 50)), jnp.float32)
    check_tree(build(jnp.array([1, 2]), logits, 64, 5), 64)


# ----------------------------------------------------------------------------- drafters


def sequences(rows: list[list[int]], slots: int) -> Sequences:
    tokens = np.zeros((len(rows), slots), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    n = jnp.asarray([len(r) for r in rows], jnp.int32)
    return Sequences(jnp.asarray(tokens), n, n, jnp.zeros(len(rows), bool), jnp.zeros((len(rows), slots)))


def test_model_drafter_cache_is_rewritten_after_an_off_chain_path():
    """Round 1 drafts a chain; the tree then accepts two tokens that are not the chain's. Round 2's
    logits must equal those of a drafter that saw the committed tokens from scratch: the catch-up
    forward rewrote the slots the chain had filled. The chain drafter's width-2 catch-up would not."""
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    params = init_random_params(cfg, jax.random.PRNGKey(SEED), scale=0.5)
    drafter = layer_skip_drafter(params, cfg, 2, 4)
    init = jax.jit(lambda tokens, n: drafter.init(tokens, n, 32))
    propose_logits = jax.jit(drafter.propose_logits)
    seqs = sequences([[3, 1, 4, 1, 5, 9]], 32)
    cache = init(seqs.tokens[:, :6], seqs.length)
    chain, _, cache = propose_logits(cache, seqs)
    off_chain = [(int(chain[0, 0]) + 1) % 32, (int(chain[0, 1]) + 1) % 32, 7]  # two drafts + bonus
    after = commit(seqs, jnp.asarray([off_chain + [0, 0]]), jnp.array([3]), GenerationConfig(max_new_tokens=10))
    _, got, _ = propose_logits(cache, after)
    _, want, _ = propose_logits(init(after.tokens[:, :9], jnp.array([9])), after)
    np.testing.assert_allclose(got, want, atol=1e-4)
    _, stale, _ = jax.jit(drafter.propose, static_argnums=3)(cache, after, jax.random.PRNGKey(0),
                                                             SamplingConfig(temperature=1.0))
    assert not np.allclose(stale, jax.nn.softmax(want, -1), atol=1e-3)


def test_ngram_scores_rank_the_chain_first_then_seen_continuations():
    seqs = sequences([[1, 2, 3, 4, 1, 2, 5, 6, 1, 2]], 24)
    draft, scores, _ = jax.jit(NgramDrafter(k=3, vocab_size=8).propose_logits)((), seqs)
    order = np.argsort(-np.asarray(scores)[0], axis=-1)
    assert draft[0].tolist() == [5, 6, 1]  # the latest match's continuation, as `propose`
    assert order[:, 0].tolist() == [5, 6, 1] and order[:, 1].tolist() == [3, 4, 2]  # then the older match
    assert (np.asarray(scores)[0, 0, 7] < np.asarray(scores)[0, 0, 4])  # unseen below seen (4 is in context)


# ----------------------------------------------------------------------------- engine


def random_config(rng) -> ModelConfig:
    """A small dense fp32 config: GQA, RoPE scaling, tied head, qk-norm and bias variants."""
    kv = int(rng.choice([1, 2]))
    scaling = [None, RopeScaling("linear", 2.0), RopeScaling("llama3", 4.0, 1.0, 4.0, 16)][rng.integers(3)]
    return ModelConfig(
        vocab_size=int(rng.integers(24, 97)), hidden_size=int(rng.choice([16, 32])),
        intermediate_size=int(rng.choice([24, 64])), num_layers=int(rng.integers(2, 4)),
        num_heads=kv * int(rng.choice([1, 2])), num_kv_heads=kv, head_dim=int(rng.choice([4, 8])),
        rope_theta=float(rng.choice([100.0, 10000.0])), rope_scaling=scaling,
        tie_word_embeddings=bool(rng.integers(2)), qk_norm=bool(rng.integers(2)),
        attention_bias=bool(rng.integers(2)), max_position_embeddings=256)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(SEED)
    cfg = random_config(rng)
    params = init_random_params(cfg, jax.random.PRNGKey(SEED), scale=0.5)
    alphabet = int(rng.integers(3, 12))  # small alphabets repeat, so n-grams match
    prompts = [[int(t) for t in rng.integers(0, alphabet, n)] for n in rng.integers(1, 20, 2)]
    gen = GenerationConfig(max_new_tokens=int(rng.integers(12, 25)))
    return cfg, params, prompts, gen, Decoder(cfg, params, gen).generate(prompts)


K = 4
TOL = 1e-3  # near-tie margin, in logits (as tests/test_token_exactness.py)
# every drafter meets every builder, a 1-node and a 64-node budget, and one degenerate static shape
TREES = {
    "block": [TreeSpec.budget("best_first", 64, K), TreeSpec.budget("topk", 1, K),
              TreeShape((-1,) + (0,) * 8)],  # all siblings
    "layerskip": [TreeSpec.budget("topk", 64, K), TreeSpec.budget("best_first", 1, K),
                  TreeShape.chain(K)],
    "ngram": [TreeSpec.budget("best_first", 64, K), TreeSpec.budget("topk", 1, K),
              TreeSpec.budget("static", 64, K), TreeShape((-1,))],  # a single node: the root alone
}


def make_drafter(kind, cfg, params):
    if kind == "block":
        return init_block_drafter(params, cfg, jax.random.PRNGKey(SEED + 1), K + 1, 1)
    if kind == "layerskip":
        return layer_skip_drafter(params, cfg, cfg.num_layers - 1, K)
    return NgramDrafter(k=K, vocab_size=cfg.vocab_size)


@pytest.mark.parametrize("kind", sorted(TREES))
def test_token_forcing_passes_every_builder_and_drafter(case, kind):
    """Zero failures: every position equals AR but near ties (reference margin < TOL, where float
    order alone may flip a choice; reported apart, none expected). Free-running greedy output is
    token-identical to AR too (first tree; whenever the reference has no near tie)."""
    cfg, params, prompts, gen, ref = case
    drafter = make_drafter(kind, cfg, params)
    for i, tree in enumerate(TREES[kind]):
        decoder = Decoder(cfg, params, gen, drafter, tree=tree)
        report = check_token_forcing(decoder, prompts, ref, tolerance=TOL)
        assert report.passed, f"seed {SEED} {tree}: {report.summary()} {report.failures[:3]}"
        if i == 0 and min(min(m, default=np.inf) for m in ref.margins) >= TOL:
            assert decoder.generate(prompts).tokens == ref.tokens, f"seed {SEED} {tree}"


def test_cost_model_counts_the_wider_catch_up_of_layer_skip_trees():
    """Under trees the layer-skip drafter re-feeds k + 1 tokens per round instead of 2. With every
    forward compute-bound (100 MFLOP per token and layer: 10 ms, against 1 ms of reads), the draft
    time grows by (k + 1 - 2) tokens through the drafter's 2 layers."""
    from specjax.costmodel.hardware import DeviceModel
    from specjax.costmodel.model import KMAX, ModelDims, predict
    dev = DeviceModel("test", bandwidth=1e9, flops=1e10, step_overhead=1e-3, round_overhead=2e-3,
                      peak_bandwidth=2e9, peak_flops=2e10)
    dims = ModelDims(layer_bytes=1e6, head_bytes=0.0, layer_flops=1e8, head_flops=0.0, kv_bytes_per_slot=0.0,
                     attn_flops_per_slot=0.0, num_layers=10, num_slots=64)
    alpha = np.full((2, KMAX), 0.5)
    p = predict(dims, dev, [4, 4], [2, 2], [2, 2], alpha, tree_nodes=[0, 8])
    one_layer = 1e8 / 1e10  # per token and layer: 10 ms compute, 1 ms of reads
    chain, tree = p["component_time"][:, 1]
    assert chain == pytest.approx(dev.step_overhead * 4 + 2 * (2 + 3) * one_layer, rel=1e-6)
    assert tree - chain == pytest.approx(2 * (5 - 2) * one_layer, rel=1e-6)
