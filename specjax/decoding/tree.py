"""Tree speculative decoding: the drafter's per-position distributions become a token tree (a
builder's choice, per row and per step: trees/builders.py), the target verifies every node in one
forward under the tree's visibility mask, and the path it accepts is committed (its K/V moved to
contiguous slots). Greedy: the longest path the target agrees with; sampled: sequential candidate
tests down the tree (exact in distribution).

Drafters: those that give per-position draft logits in one forward (`block_logits`: block drafters),
or along their own chain (`propose_logits`: model drafters, n-gram).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.decoding.chain import ChainStats, Forced, committed_drafts, finish_round, packed_counts
from specjax.decoding.sequences import GenerationConfig, Sequences
from specjax.decoding.two_level import verify_two_level
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.params import ModelParams
from specjax.models.target import is_hybrid, target_commit, target_logits, target_verify, with_replay_width
from specjax.models.transformer import TreeMask
from specjax.sampling import SamplingConfig, probabilities, top2_margin
from specjax.trees.builders import LOGP_FLOOR, TreeSpec, as_tree_spec, build_tree
from specjax.trees.tree import Tree
from specjax.trees.verify import greedy_tree_accept, sampled_tree_accept, tree_mask
from specjax.rounding import exact_jit


def check_tree_drafter(drafter, tree, gen: GenerationConfig) -> None:
    """tree: a `TreeSpec` or a `TreeShape`."""
    spec = as_tree_spec(tree)
    if not (hasattr(drafter, "block_logits") or hasattr(drafter, "propose_logits")):
        raise NotImplementedError(f"tree verification needs per-position draft distributions "
                                  f"(block_logits or propose_logits); {type(drafter).__name__} has none")
    if getattr(drafter, "vocab_size", None) == 0:  # an n-gram drafter built without it
        raise ValueError(f"{type(drafter).__name__} needs vocab_size to score tree alternatives")
    if spec.max_depth > drafter.k:
        raise ValueError(f"tree depth {spec.max_depth} exceeds the drafter's {drafter.k} positions")


def default_builder(drafter) -> str:
    """best_first where the distributions hold for every path (block drafters), else topk (AR
    drafters know their distributions only along their own chain)."""
    return "best_first" if hasattr(drafter, "block_logits") else "topk"


def draft_scores(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """What the builders rank by: the draft distribution the step samples under (temperature, top-p),
    as log-probabilities; greedy: the logits themselves."""
    if sampling.greedy:
        return logits
    return jnp.maximum(jnp.log(probabilities(logits, sampling)), LOGP_FLOOR)


def draft_tree(drafter, spec: TreeSpec, sampling: SamplingConfig, dstate, seqs: Sequences) -> tuple[Tree, object]:
    """-> (the step's tree, the drafter state). Deterministic given the committed tokens and the
    drafter state: AR drafters draft their chain greedily (candidates are tested as fixed tokens,
    so sampling them would only lose acceptance)."""
    if hasattr(drafter, "block_logits"):
        logits, chain = drafter.block_logits(dstate, seqs), None
    else:
        chain, logits, dstate = drafter.propose_logits(dstate, seqs)
        chain = chain[:, :spec.max_depth]
    logits = draft_scores(logits[:, :spec.max_depth], sampling)
    return build_tree(spec, seqs.pending(), logits, chain), dstate


def tree_step(target: ModelParams, cfg: ModelConfig, drafter, spec: TreeSpec, gen: GenerationConfig,
              cache: KVCache, dstate, seqs: Sequences, stats: ChainStats, key, forced: Forced | None = None,
              num_drafts: jax.Array | None = None, two_level_k1: int | None = None,
              packed_bucket: int | None = None):
    """One tree round. num_drafts [B] (a serving budget): only each row's first num_drafts[b]
    nodes are verified (a subtree). two_level_k1: verify nodes 0..k1 first (a subtree), and the
    whole tree only for rows whose walk steps past them (`decoding/two_level.py`).
    packed_bucket (hybrid targets): pack the verified nodes into one flat bucket (`chain_step`)."""
    pos = seqs.length - 1  # the pending token's slot: the tree's root
    tree, dstate = draft_tree(drafter, spec, gen.sampling, dstate, seqs)
    if num_drafts is not None:
        tree = tree.first_nodes(num_drafts)
    taps = getattr(drafter, "taps", ())

    N = tree.num_nodes
    anc = tree.ancestors()
    depths = tree.depths(anc)
    reach = N - 1 if num_drafts is None else num_drafts

    def verify(first, width, cache, rows=None, prefix=None):  # nodes first .. width - 1
        # nodes 0 .. width - 1 form a subtree (parents come first); with a prefix (level 1's
        # nodes 0 .. first - 1) the later nodes are verified on level 1's cache
        sub = Tree(tree.tokens[:, :width], tree.parents[:, :width], tree.max_depth)
        sub_anc = anc[:, :width, :width]
        mask = TreeMask(tree_mask(sub, pos, cache.num_slots, sub_anc), sub_anc, depths[:, :width], sub.max_depth)
        hidden, features, cache, pending = target_verify(
            target, cfg, sub.tokens[:, first:], pos[:, None] + depths[:, first:width], cache, pos + first, taps, mask,
            sub.parents, sub_anc, sub.max_depth, packed_counts(seqs, reach, first, width, rows, packed_bucket),
            prefix)
        return target_logits(target, cfg, hidden), features, cache, pending

    def walk(logits):
        if gen.sampling.greedy:
            return greedy_tree_accept(tree, logits)
        return sampled_tree_accept(tree, probabilities(logits, gen.sampling), key)

    if two_level_k1 is None:
        logits, features, cache, pending = verify(0, N, cache)  # logits [B, N, V]
    else:
        # each node's test reads its parent's logits only, so the walk over level 1's (zeros past
        # them) is the true walk until it first steps onto a later node: those rows verify the
        # rest (docs/design/serving_trees.md); the others have their final result
        k1 = two_level_k1
        if not is_hybrid(cfg):
            raise ValueError("two-level verification in tree_step is for hybrid targets (the serving engine's "
                             "dense steps verify two levels themselves)")
        logits, features, cache, pending = verify_two_level(
            lambda c: verify(0, k1 + 1, c), lambda c, p, rows: verify(k1 + 1, N, c, rows, p), cache, k1 + 1, N,
            lambda logits1: ~seqs.done & (walk(logits1)[1][:, -1] > k1))
    num_accepted, path, out = walk(logits)
    if taps:  # the accepted path's features, at contiguous positions (the rest is never read)
        dstate = drafter.observe(dstate, jnp.take_along_axis(features, path[..., None], axis=1), pos)
    margins = jnp.take_along_axis(top2_margin(logits), path, axis=1)
    before = seqs.length
    seqs, stats, forced = finish_round(gen, seqs, stats, forced, out, num_accepted, margins)
    cache = target_commit(target, cfg, cache, pending, path, committed_drafts(before, seqs), pos)
    return cache, dstate, seqs, stats, forced


@functools.partial(exact_jit, static_argnames=("cfg", "gen", "tree"))
def tree_decode(target, cfg, drafter, gen, tree, cache, dstate, seqs, key, forced=None):
    """Run tree steps until every row is done -> (sequences, stats, forced). tree: a `TreeSpec`
    (or a `TreeShape`: the static builder)."""
    spec = as_tree_spec(tree)
    stats = ChainStats.zeros(seqs.length.shape[0], spec.max_depth)
    cache = with_replay_width(target, cfg, cache, spec.max_depth + 1)  # a hybrid cache defers accepted paths

    def body(carry):
        cache, dstate, seqs, stats, forced, key = carry
        key, sub = jax.random.split(key)
        return (*tree_step(target, cfg, drafter, spec, gen, cache, dstate, seqs, stats, sub, forced), key)

    _, _, seqs, stats, forced, _ = jax.lax.while_loop(lambda c: ~jnp.all(c[2].done), body,
                                                      (cache, dstate, seqs, stats, forced, key))
    return seqs, stats, forced
