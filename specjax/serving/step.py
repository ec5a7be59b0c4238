"""The serving engine's device side: one jit'd call admits queued requests into free slots, runs
verify steps for every busy slot, and retires finished requests into the outbox
(docs/design/serving.md). Pure functions of the state; nothing here talks to the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import GenerationConfig
from specjax.models.config import ModelConfig
from specjax.models.target import target_logits
from specjax.sampling import probabilities, top2_margin
from specjax.serving.admit_group import GROUP, admit_group, reserve
from specjax.serving.budget import admitted_drafts, layout
from specjax.serving.flat_forward import flat_forward
from specjax.serving.paged_cache import TRASH_PAGE, pages_needed, release
from specjax.serving.round import commit_round
from specjax.serving.state import Queue, ServingOptions, ServingState
from specjax.serving.hybrid_step import verify_hybrid_step
from specjax.serving.tree_step import verify_tree_step
from specjax.verification.chain import acceptance_tests, greedy_accept, leading_true, rejection_accept
from specjax.rounding import exact_jit


def _pop(queue: Queue, keep: jax.Array) -> Queue:
    """Keep the entries where keep [Q] is True, in order, at the front."""
    order = jnp.argsort(~keep, stable=True)
    moved = {f.name: getattr(queue, f.name)[order] for f in dataclasses.fields(queue) if f.name != "count"}
    return Queue(**moved, count=jnp.sum(keep).astype(jnp.int32))


def admit(params, cfg, drafter, gen, forcing: bool, st: ServingState, overshoot: int = 0,
          batched: bool = True) -> ServingState:
    """Admit queued requests in order while a slot and the head's pages are free. `batched`
    (dense targets): while two or more can come in, prefill them in groups of up to `GROUP` in
    one forward each (`admit_group`); the last one alone."""
    k = overshoot

    def can(st):
        q = st.queue
        need = pages_needed(reserve(q.length[0], q.max_new[0], k), st.cache.page_size)
        return (q.count > 0) & ~jnp.all(st.slots.busy) & (jnp.sum(st.free) >= need)

    group = min(GROUP, st.slots.busy.shape[0], st.queue.rid.shape[0])
    if batched and st.recurrent is None and group >= 2:
        def can_group(st):  # the head fits, so each group admits at least one: the loop ends
            return can(st) & (jnp.minimum(st.queue.count, jnp.sum(~st.slots.busy)) >= 2)
        st = jax.lax.while_loop(can_group, functools.partial(
            admit_group, params, cfg, drafter, gen, forcing, k, group), st)
    return jax.lax.while_loop(can, functools.partial(admit_group, params, cfg, drafter, gen, forcing, k, 1), st)


def _level(params, cfg, st, taps, table, first_pos, col0, width, counts, packed, bucket, attention="xla"):
    batch = layout(table, first_pos, col0, width, counts, packed, bucket)
    hidden, features, cache = flat_forward(params, cfg, batch, st.slots.pages, st.cache, taps, attention)
    logits = target_logits(params, cfg, hidden)[batch.unpack]  # [B, width, V]
    feats = None if features is None else features[batch.unpack]
    return logits, feats, cache


def verify_step(params, cfg: ModelConfig, drafter, gen: GenerationConfig, opts: ServingOptions,
                forcing: bool, st: ServingState) -> ServingState:
    """Draft, pick the drafts to verify, verify them (one or two levels), accept, commit."""
    s = st.slots
    seqs = s.seqs
    B = seqs.length.shape[0]
    active = s.busy & ~seqs.done
    key, key_d, key_v = jax.random.split(st.key, 3)
    dstate = st.dstate
    if drafter is None:
        k, draft, q = 0, jnp.zeros((B, 0), jnp.int32), None
    else:
        k = drafter.k
        draft, q, dstate = drafter.propose(dstate, seqs, key_d, gen.sampling)
    # Which drafts get verified must not depend on the drafted tokens themselves: choosing by
    # q(d_i) would verify the drafts that happened to be likely under q, and rejection sampling's
    # residual is calibrated for verifying every draw (the sampled output drifted off the target:
    # tests/test_serving_sampling.py). The drafter's peak probability per position is a function
    # of the context and the earlier drafts only, and so is the running acceptance rate.
    confidence = (jnp.broadcast_to(s.accept_rate[:, None], (B, k)) if q is None else
                  jnp.max(q, axis=-1))
    n_drafts = admitted_drafts(confidence, active, opts.budget)
    table = jnp.concatenate([seqs.pending()[:, None], draft], axis=1)  # [B, k + 1]
    first_pos = seqs.length - 1
    taps = getattr(drafter, "taps", ())
    budget = opts.draft_budget(k, B)
    k1 = opts.two_level_k1
    width1 = k + 1 if k1 is None else k1 + 1
    counts1 = jnp.where(active, jnp.minimum(n_drafts + 1, width1), 0)
    logits, feats, cache = _level(params, cfg, st, taps, table, first_pos, 0, width1, counts1,
                                  opts.packed, B + min(budget, B * (width1 - 1)), opts.attention)
    st = dataclasses.replace(st, cache=cache)
    limit = n_drafts
    if k1 is not None:  # level 2: the rest of the drafts, where all k1 of level 1 passed
        if gen.sampling.greedy:
            passed = draft[:, :k1] == jnp.argmax(logits[:, :k1], axis=-1)
        else:
            # all k positions, as `rejection_accept` draws them: the uniforms of a [B, k1] draw
            # are not those of the first k1 columns of a [B, k] draw (rows past the first differ)
            padded = jnp.pad(logits, ((0, 0), (0, k - k1), (0, 0)))
            passed = acceptance_tests(draft, q, probabilities(padded, gen.sampling), key_v)[:, :k1]
        promoted = active & (n_drafts > k1) & (leading_true(passed) == k1)
        counts2 = jnp.where(promoted, n_drafts - k1, 0)
        bucket2 = min(budget, B * (k - k1))
        if opts.packed and opts.two_level_tokens is not None:  # a smaller bucket: the best drafts
            bucket2 = min(bucket2, opts.two_level_tokens)
            counts2 = jnp.minimum(counts2, admitted_drafts(confidence[:, k1:], promoted, bucket2))

        def level2(st):
            return _level(params, cfg, st, taps, table, first_pos, k1 + 1, k - k1, counts2, opts.packed,
                          bucket2, opts.attention)

        def skip(st):  # nobody passed level 1: no second weight read
            shapes = jax.eval_shape(level2, st)
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[:2]) + (st.cache,)

        logits2, feats2, cache = jax.lax.cond(jnp.any(counts2 > 0), level2, skip, st)
        st = dataclasses.replace(st, cache=cache)
        logits = jnp.concatenate([logits, logits2], axis=1)
        feats = None if feats is None else jnp.concatenate([feats, feats2], axis=1)
        limit = jnp.where(promoted, k1 + counts2, jnp.minimum(n_drafts, k1))
    if taps:
        dstate = drafter.observe(dstate, feats, first_pos)
    verified = jnp.arange(k + 1)[None, :] <= limit[:, None]
    failed = active & ~jnp.all(jnp.isfinite(logits) | ~verified[..., None], axis=(1, 2))
    if gen.sampling.greedy:
        num_accepted, out = greedy_accept(draft, logits, limit)
    else:
        num_accepted, out = rejection_accept(draft, q, probabilities(logits, gen.sampling), key_v, limit)
    slots = commit_round(s, out, num_accepted, top2_margin(logits), failed, active, n_drafts,
                         jnp.maximum(n_drafts, 1), gen, forcing)
    return dataclasses.replace(st, slots=slots, dstate=dstate, key=key)


def retire(st: ServingState) -> ServingState:
    """Move finished requests to the outbox and free their slots and pages."""
    s, o = st.slots, st.outbox
    fin = s.busy & s.seqs.done
    idx = jnp.where(fin, o.count + jnp.cumsum(fin) - 1, o.rid.shape[0])  # out of range: dropped

    def put(dst, src):
        return dst.at[idx].set(src, mode="drop")
    outbox = dataclasses.replace(
        o, tokens=put(o.tokens, s.seqs.tokens), length=put(o.length, s.seqs.length),
        prompt_len=put(o.prompt_len, s.seqs.prompt_len), rid=put(o.rid, s.rid),
        rounds=put(o.rounds, s.rounds), committed=put(o.committed, s.committed),
        accepted_hist=put(o.accepted_hist, s.accepted_hist),
        failed=put(o.failed, s.failed), mismatch=put(o.mismatch, s.forced.mismatch),
        engine_token=put(o.engine_token, s.forced.engine_token), checked=put(o.checked, s.forced.checked),
        count=o.count + jnp.sum(fin).astype(jnp.int32))
    slots = dataclasses.replace(s, busy=s.busy & ~fin, rid=jnp.where(fin, -1, s.rid),
                                pages=jnp.where(fin[:, None], TRASH_PAGE, s.pages))
    return dataclasses.replace(st, slots=slots, outbox=outbox, free=release(st.free, s.pages, fin))


def take_inbox(st: ServingState, inbox: Queue, cancel: jax.Array) -> ServingState:
    """Start of a call: empty the outbox (the host read it), cancel requests named in `cancel`
    (queued ones are dropped, running ones finish now), append the inbox's requests."""
    q = st.queue
    Q = q.rid.shape[0]
    keep = (jnp.arange(Q) < q.count) & ~jnp.isin(q.rid, cancel)
    q = _pop(q, keep)
    pos = jnp.where(jnp.arange(Q) < inbox.count, q.count + jnp.arange(Q), Q)  # the host checked room

    def put(name):
        return getattr(q, name).at[pos].set(getattr(inbox, name), mode="drop")
    q = Queue(**{f.name: put(f.name) for f in dataclasses.fields(q) if f.name != "count"},
              count=q.count + inbox.count)
    s = st.slots
    stop = s.busy & jnp.isin(s.rid, cancel)
    seqs = dataclasses.replace(s.seqs, done=s.seqs.done | stop)
    return dataclasses.replace(st, queue=q, slots=dataclasses.replace(s, seqs=seqs),
                               outbox=dataclasses.replace(st.outbox, count=jnp.int32(0)))


def _serve_call(params, cfg, drafter, gen, opts: ServingOptions, forcing: bool, st: ServingState,
               inbox: Queue, cancel: jax.Array) -> tuple[ServingState, jax.Array]:
    """One device call: take the inbox, then up to `opts.steps_per_call` rounds of
    admit -> verify step -> retire, stopping early when nothing is left to do or the outbox
    could overflow. Returns (state, steps run)."""
    st = retire(take_inbox(st, inbox, cancel))
    B = st.slots.busy.shape[0]

    def cond(carry):
        st, i = carry
        room = st.outbox.rid.shape[0] - st.outbox.count >= B
        return (i < opts.steps_per_call) & room & (jnp.any(st.slots.busy) | (st.queue.count > 0))

    def body(carry):
        st, i = carry
        k = 0 if drafter is None else drafter.k
        st = admit(params, cfg, drafter, gen, forcing, st, opts.overshoot(k), opts.batched_prefill)
        step = verify_hybrid_step if st.recurrent is not None else \
            verify_step if opts.tree is None else verify_tree_step
        st = retire(step(params, cfg, drafter, gen, opts, forcing, st))
        return st, i + 1

    return jax.lax.while_loop(cond, body, (st, jnp.int32(0)))


_STATIC = ("cfg", "gen", "opts", "forcing")
serve_call = exact_jit(_serve_call, static_argnames=_STATIC)
# on GPUs the state's buffers (the whole paged cache) are reused in place; CPUs cannot donate
serve_call_donating = exact_jit(_serve_call, static_argnames=_STATIC, donate_argnames=("st",))
