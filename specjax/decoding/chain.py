"""Chain speculative decoding: draft k tokens, verify all k + 1 positions in one target forward,
commit the accepted prefix plus the target's own next token. The loop stays on the device.

Rejected drafts need no cache rollback: their K/V sit past the new length, masked and then
overwritten (see decoding/sequences.py). With `forced` set, the step runs in token-forcing mode: the
engine's choices are compared with a reference and the reference is committed (forcing.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import GenerationConfig, Sequences, commit, prefill, start_sequences
from specjax.decoding.two_level import verify_two_level
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, read_rows
from specjax.models.params import ModelParams
from specjax.models.target import (chain_path, chain_verify, is_hybrid, target_commit, target_logits,
                                   with_replay_width)
from specjax.sampling import probabilities, top2_margin
from specjax.verification.chain import acceptance_tests, greedy_accept, leading_true, rejection_accept
from specjax.rounding import exact_jit


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainStats:
    rounds: jax.Array  # [B] verify steps while the row was active
    accepted_hist: jax.Array  # [B, k + 1] rounds by number of accepted drafts

    @staticmethod
    def zeros(batch: int, k: int) -> "ChainStats":
        return ChainStats(jnp.zeros(batch, jnp.int32), jnp.zeros((batch, k + 1), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Forced:
    """Token-forcing inputs and findings (see forcing.py)."""
    ref_tokens: jax.Array  # [B, S] reference sequence (prompt + AR continuation)
    ref_length: jax.Array  # [B]
    mismatch: jax.Array  # [B, S] bool: the engine chose differently at this position
    engine_token: jax.Array  # [B, S] the engine's choice where it differed
    checked: jax.Array  # [B, S] bool: the engine's choice at this position was compared


def force(forced: Forced, seqs: Sequences, out, num_accepted):
    """Compare the engine's tokens out[:, :num_accepted + 1] with the reference at the same positions,
    record disagreements, and return what to commit instead: the reference up to and including the
    first disagreement (its accepted drafts agree with the reference, so the cache stays valid)."""
    start = seqs.length  # sequence index of out[:, 0]
    width = out.shape[1]
    ref = read_rows(forced.ref_tokens, start, width)
    first_diff = leading_true(out == ref)  # width when all agree
    keep = jnp.minimum(num_accepted, first_diff)
    idx = start + first_diff
    active = ~seqs.done
    differs = active & (first_diff <= num_accepted) & (idx < forced.ref_length)
    rows = jnp.arange(out.shape[0])
    out_at = jnp.take_along_axis(out, jnp.minimum(first_diff, width - 1)[:, None], axis=1)[:, 0]
    pos = jnp.arange(forced.checked.shape[1])[None, :]
    newly_checked = active[:, None] & (pos >= start[:, None]) & (pos <= (start + keep)[:, None]) & (
        pos < forced.ref_length[:, None])
    where = jnp.where(differs, idx, forced.checked.shape[1])  # out of bounds: dropped
    forced = dataclasses.replace(
        forced,
        mismatch=forced.mismatch.at[rows, where].set(True, mode="drop"),
        engine_token=forced.engine_token.at[rows, where].set(out_at, mode="drop"),
        checked=forced.checked | newly_checked)
    return forced, ref, keep


def chain_step(target: ModelParams, cfg: ModelConfig, drafter, gen: GenerationConfig, cache: KVCache,
               dstate, seqs: Sequences, stats: ChainStats, key, forced: Forced | None = None,
               num_drafts: jax.Array | None = None, two_level_k1: int | None = None,
               packed_bucket: int | None = None, two_level_tokens: int | None = None,
               confidence: jax.Array | None = None):
    """One draft -> verify -> accept -> commit round. num_drafts [B] (a serving budget): only the
    first num_drafts[b] drafts may be accepted. packed_bucket (hybrid targets): verify only those
    drafts, packed into a flat bucket of at most this many tokens (`packed_counts`).
    two_level_k1 (hybrid targets; the serving engine's two-level switch): verify pending + k1
    drafts first, and the later drafts only where the k1 passed and some row did, on level 1's
    cache and GDN inputs (`decoding/two_level.py`). two_level_tokens (with packed_bucket): level 2
    verifies at most this many drafts over the batch, the best by survival score of `confidence`
    [B, k] (a function of the context, never of the drafted tokens, as the serving budget's),
    and a promoted row may accept only the drafts it verified."""
    key_d, key_v = jax.random.split(key)
    draft, draft_probs, dstate = drafter.propose(dstate, seqs, key_d, gen.sampling)
    k = draft.shape[1]
    pos = seqs.length - 1
    tokens = jnp.concatenate([seqs.pending()[:, None], draft], axis=1)  # [B, k + 1]
    taps = getattr(drafter, "taps", ())  # block drafters condition on target hidden states

    reach = k if num_drafts is None else num_drafts

    def verify(first, width, cache, rows=None, prefix=None, reach=reach, bucket=packed_bucket):
        start = pos + first  # tokens first .. width - 1
        positions = start[:, None] + jnp.arange(width - first, dtype=jnp.int32)[None, :]
        pack = packed_counts(seqs, reach, first, width, rows, bucket)
        hidden, features, cache, pending = chain_verify(target, cfg, tokens[:, first:width], positions, cache, start,
                                                        taps, pack, prefix)
        return target_logits(target, cfg, hidden), features, cache, pending

    if two_level_k1 is None:
        logits, features, cache, pending = verify(0, k + 1, cache)  # logits [B, k + 1, V]
    else:
        k1 = two_level_k1
        if not is_hybrid(cfg):
            raise ValueError("two-level verification in chain_step is for hybrid targets (the serving engine's "
                             "dense steps verify two levels themselves)")

        def promoted_of(logits1):
            # level 2 where all k1 drafts pass the tests the full rule runs (the same uniforms:
            # `acceptance_tests` over all k positions, as `rejection_accept` draws them; logits1 is
            # zero past level 1); elsewhere the full rule stops inside level 1
            if gen.sampling.greedy:
                passed = draft[:, :k1] == jnp.argmax(logits1[:, :k1], axis=-1)
            else:
                passed = acceptance_tests(draft, draft_probs, probabilities(logits1, gen.sampling), key_v)[:, :k1]
            return ~seqs.done & (reach > k1) & (leading_true(passed) == k1)
        def reach_of(promoted):  # drafts a promoted row verifies, in all
            if two_level_tokens is None:
                return reach
            from specjax.serving.budget import admitted_drafts  # serving's ranking rule
            later = jnp.clip(jnp.asarray(reach) - k1, 0, k - k1)
            return k1 + jnp.minimum(later, admitted_drafts(confidence[:, k1:], promoted, two_level_tokens))

        if two_level_tokens is not None and (packed_bucket is None or confidence is None):
            raise ValueError("two_level_tokens sizes a packed level-2 bucket: it needs packed_bucket and "
                             "confidence")
        bucket2 = packed_bucket if two_level_tokens is None else min(packed_bucket, two_level_tokens)
        logits, features, cache, pending = verify_two_level(
            lambda c: verify(0, k1 + 1, c),
            lambda c, p, rows: verify(k1 + 1, k + 1, c, rows, p, reach_of(rows), bucket2),
            cache, k1 + 1, k + 1, promoted_of)
        if two_level_tokens is not None:  # promotion reads level 1's logits only: recomputed alike
            promoted = promoted_of(logits)
            num_drafts = jnp.where(promoted, reach_of(promoted), reach)
    if taps:  # all k + 1 positions: only the accepted ones are ever read (see drafters/block.py)
        dstate = drafter.observe(dstate, features, pos)
    limit = () if num_drafts is None else (num_drafts,)  # the plain rule's own call without a budget
    if gen.sampling.greedy:
        num_accepted, out = greedy_accept(draft, logits, *limit)
    else:
        num_accepted, out = rejection_accept(draft, draft_probs, probabilities(logits, gen.sampling), key_v,
                                             *limit)
    before = seqs.length
    seqs, stats, forced = finish_round(gen, seqs, stats, forced, out, num_accepted, top2_margin(logits))
    cache = target_commit(target, cfg, cache, pending, chain_path(*tokens.shape), committed_drafts(before, seqs),
                          pos, is_chain=True)
    return cache, dstate, seqs, stats, forced


def packed_counts(seqs: Sequences, reach, first: int, width: int, rows, bucket: int | None):
    """(counts [B], bucket) for a packed verify of tokens first .. width - 1 of each row, or None
    (not packed): each unfinished row (of `rows`, if given) takes those of its pending token and
    `reach` [B] drafts (or nodes), the others nothing. bucket bounds sum(counts) (the caller's
    B + draft budget)."""
    if bucket is None:
        return None
    use = ~seqs.done if rows is None else rows & ~seqs.done
    counts = jnp.clip(jnp.minimum(jnp.asarray(reach) + 1, width) - first, 0, width - first)
    return jnp.where(use, counts, 0).astype(jnp.int32), min(seqs.length.shape[0] * (width - first), bucket)


def committed_drafts(length_before: jax.Array, seqs: Sequences) -> jax.Array:
    """[B] drafts a round committed, after forcing may have cut them (the token after them is the
    new pending one, not yet fed): what a recurrent state must advance over, besides the root."""
    return jnp.maximum(seqs.length - length_before - 1, 0)


def finish_round(gen: GenerationConfig, seqs: Sequences, stats: ChainStats, forced: Forced | None,
                 out, num_accepted, margins):
    """The end of a verify step, chain or tree: count the round, let token forcing replace what
    differs from the reference, and commit out[:, :num_accepted + 1]."""
    active = ~seqs.done
    stats = ChainStats(
        rounds=stats.rounds + active,
        accepted_hist=stats.accepted_hist + (
            active[:, None] & (num_accepted[:, None] == jnp.arange(out.shape[1])[None, :])))
    limit = None
    if forced is not None:
        forced, out, num_accepted = force(forced, seqs, out, num_accepted)
        limit = forced.ref_length
    return commit(seqs, out, num_accepted + 1, gen, margins=margins, limit=limit), stats, forced


@functools.partial(exact_jit, static_argnames=("cfg", "gen", "num_slots"))
def chain_prefill(target, cfg, drafter, gen, prompt, prompt_len, key, num_slots):
    taps = getattr(drafter, "taps", ())
    cache, seqs, _, features = prefill(target, cfg, gen, prompt, prompt_len, num_slots, key, taps)
    # drafters without taps keep the plain init(prompt, prompt_len, num_slots) protocol
    extra = {"features": features} if taps else {}
    dstate = drafter.init(prompt, prompt_len, num_slots, **extra)
    return cache, dstate, seqs


@functools.partial(exact_jit, static_argnames=("gen", "num_slots"))
def chain_start(drafter, gen, cache, logits, features, prompt, prompt_len, key, num_slots):
    """`chain_prefill` after a shared `prompt_pass` (what `Decoder` runs: see sequences.prompt_pass)."""
    cache, seqs = start_sequences(gen, cache, logits, prompt, prompt_len, num_slots, key)
    extra = {"features": features} if getattr(drafter, "taps", ()) else {}
    return cache, drafter.init(prompt, prompt_len, num_slots, **extra), seqs


@functools.partial(exact_jit, static_argnames=("cfg", "gen"))
def chain_decode(target, cfg, drafter, gen, cache, dstate, seqs, key, forced=None):
    """Run chain steps until every row is done -> (sequences, stats, forced)."""
    stats = ChainStats.zeros(seqs.length.shape[0], drafter.k)
    cache = with_replay_width(target, cfg, cache, drafter.k + 1)  # a hybrid cache defers accepted paths

    def cond(carry):
        return ~jnp.all(carry[2].done)

    def body(carry):
        cache, dstate, seqs, stats, forced, key = carry
        key, sub = jax.random.split(key)
        cache, dstate, seqs, stats, forced = chain_step(
            target, cfg, drafter, gen, cache, dstate, seqs, stats, sub, forced)
        return cache, dstate, seqs, stats, forced, key

    _, _, seqs, stats, forced, _ = jax.lax.while_loop(
        cond, body, (cache, dstate, seqs, stats, forced, key))
    return seqs, stats, forced
