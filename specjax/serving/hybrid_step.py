"""Hybrid (Gated DeltaNet + attention) targets in the serving engine (docs/design/serving_hybrid.md).

Each slot keeps its GDN states, conv windows and deferred accepted path in `ServingState.recurrent`
(a `HybridCache` without K/V); the attention layers' K/V live in the paged pool. A step gathers
every slot's pages into a dense view, runs the decoder's own chain or tree step over the slots
(`decoding.chain.chain_step`, `decoding.tree.tree_step`: replay of the deferred path, verify,
accept, commit), and scatters the views back. The numerics are the decoder's, so each request's
tokens are what `engine.Decoder` gives it. Attention: XLA's over the views, or (`attention`
"pallas"/"interpret") the ragged paged kernel over the pools in place, with no views: the
decoder's step then runs on the cache's paged form (`HybridCache.pages`). The budget, packing
and two-level verification pass through to the decoder's steps (`num_drafts`, `packed_bucket`,
`two_level_k1`, `two_level_tokens`; packing: `models/row_packing.py`, two levels:
`decoding/two_level.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.decoding.ar import ar_logits
from specjax.decoding.chain import ChainStats, chain_step, finish_round
from specjax.decoding.sequences import GenerationConfig, prompt_forward
from specjax.decoding.tree import tree_step
from specjax.models.hybrid import init_hybrid_cache
from specjax.sampling import choose_token, top2_margin
from specjax.serving.budget import admitted_drafts
from specjax.serving.paged_cache import PagedKVCache, gather_view, scatter_view
from specjax.serving.state import ServingOptions, ServingState


def init_recurrent(cfg, num_slots: int, width: int):
    """Zero GDN states for `num_slots` slots deferring paths of `width` tokens (no K/V)."""
    cache = init_hybrid_cache(cfg, num_slots, 0)
    return cache.replaced(k=[], v=[], replay=jnp.zeros((num_slots, width), jnp.int32))


def replay_width(opts: ServingOptions, k: int) -> int:
    """The longest path one step can accept: k + 1 for chains, depth + 1 for trees."""
    return k + 1 if opts.tree is None else opts.tree.max_depth + 1


def _views(cache: PagedKVCache, pages: jax.Array, live: jax.Array):
    """Every slot's K/V as dense [B, L, ...] views; V zeroed at positions >= live[b] (a reused
    page may hold a failed request's NaN there, and 0 * NaN poisons attention's weighted sum)."""
    keep = (jnp.arange(pages.shape[1] * cache.page_size)[None, :] < live[:, None])[:, :, None, None]
    return ([gather_view(k, pages) for k in cache.k],
            [jnp.where(keep, gather_view(v, pages), 0) for v in cache.v])


def _scatter(cache: PagedKVCache, pages: jax.Array, k_views, v_views) -> PagedKVCache:
    return PagedKVCache(k=[scatter_view(p, pages, x) for p, x in zip(cache.k, k_views)],
                        v=[scatter_view(p, pages, x) for p, x in zip(cache.v, v_views)])


def admit_hybrid(params, cfg, prompt, plen, row, slot, st: ServingState, taps):
    """Prefill one request (prompt [P] right-padded, plen) into block-table row `row` and slot
    `slot` -> (first-token logits [1, V], tapped features or None, new cache, new recurrent)."""
    cache1, logits, features = prompt_forward(params, cfg, prompt[None], plen[None], taps)
    P = prompt.shape[0]
    L = row.shape[0] * st.cache.page_size
    pad = lambda x: jnp.pad(x, ((0, 0), (0, L - P)) + ((0, 0),) * (x.ndim - 2))
    cache = _scatter(st.cache, row[None], [pad(x) for x in cache1.k], [pad(x) for x in cache1.v])
    rec = st.recurrent
    rec = rec.replaced(state=[s.at[slot].set(n[0]) for s, n in zip(rec.state, cache1.state)],
                       conv=[c.at[slot].set(n[0]) for c, n in zip(rec.conv, cache1.conv)],
                       replay_len=rec.replay_len.at[slot].set(0))
    return logits, features, cache, rec


def verify_hybrid_step(params, cfg, drafter, gen: GenerationConfig, opts: ServingOptions, forcing: bool,
                       st: ServingState) -> ServingState:
    """One chain or tree step of the decoder over every slot's views; per-slot max_new applied."""
    s = st.slots
    seqs = s.seqs
    B = seqs.length.shape[0]
    active = s.busy & ~seqs.done
    key, sub = jax.random.split(st.key)
    paged = opts.attention != "xla"
    if paged:  # the attention layers read and write the pools in place (the paged kernel)
        hcache = st.recurrent.replaced(k=st.cache.k, v=st.cache.v, pages=s.pages, paged=opts.attention)
    else:
        k_views, v_views = _views(st.cache, s.pages, seqs.length - 1)
        hcache = st.recurrent.replaced(k=k_views, v=v_views)
    W = 1 if drafter is None else replay_width(opts, drafter.k)
    stats = ChainStats(rounds=jnp.zeros(B, jnp.int32), accepted_hist=jnp.zeros((B, W), jnp.int32))
    forced = s.forced if forcing else None
    before = seqs.length
    dstate = st.dstate
    n_drafts = None
    if drafter is None:  # plain AR: the GDN states advance over each token as it is decoded
        # ended as a verify round is, so token forcing works here too: a token that differs from
        # the reference is recorded and replaced, and the next step feeds the reference's
        logits, hcache = ar_logits(params, cfg, hcache, seqs)
        token = choose_token(logits, gen.sampling, sub)
        seqs, stats, forced = finish_round(gen, seqs, stats, forced, token[:, None], jnp.zeros(B, jnp.int32),
                                           top2_margin(logits)[:, None])
    else:
        # the budget admits drafts by the slot's running acceptance rate (never the drafted
        # tokens, see step.py); the padded layout verifies every row's k + 1 tokens regardless
        n = opts.drafts(drafter.k)
        confidence = jnp.broadcast_to(s.accept_rate[:, None], (B, n))
        if opts.budget is not None:
            n_drafts = admitted_drafts(confidence, active, opts.budget)
        step = chain_step if opts.tree is None else functools.partial(tree_step, spec=opts.tree)
        if opts.two_level_tokens is not None:  # chains only (ServingOptions refuses it for trees)
            step = functools.partial(step, two_level_tokens=opts.two_level_tokens, confidence=confidence)
        # packed: each slot's pending token and admitted drafts (and its deferred path) only
        bucket = B + opts.draft_budget(drafter.k, B) if opts.packed else None
        hcache, dstate, seqs, stats, forced = step(params, cfg, drafter, gen=gen, cache=hcache, dstate=st.dstate,
                                                   seqs=seqs, stats=stats, key=sub, forced=forced,
                                                   num_drafts=n_drafts, two_level_k1=opts.two_level_k1,
                                                   packed_bucket=bucket)
    # the slot's own max_new (the decoder's rule is one max_new_tokens for the batch)
    over = active & (seqs.length - seqs.prompt_len >= s.max_new)
    seqs = dataclasses.replace(seqs, done=seqs.done | over)
    cache = PagedKVCache(k=hcache.k, v=hcache.v) if paged else _scatter(st.cache, s.pages, hcache.k, hcache.v)
    gained = jnp.where(active, seqs.length - before, 0)
    hist = s.accepted_hist.at[:, :W].add(stats.accepted_hist)
    rate = s.accept_rate
    if drafter is not None:  # as round.commit_round: accepted drafts over the most that could be
        reach = W - 1 if n_drafts is None else jnp.minimum(n_drafts, W - 1)
        rate = jnp.where(active, 0.7 * rate + 0.3 * jnp.maximum(gained - 1, 0) / jnp.maximum(reach, 1), rate)
    slots = dataclasses.replace(s, seqs=seqs, rounds=s.rounds + active, committed=s.committed + gained,
                                accepted_hist=hist, accept_rate=rate,
                                forced=s.forced if forced is None else forced)
    return dataclasses.replace(st, slots=slots, cache=cache, dstate=dstate, key=key,
                               recurrent=hcache.replaced(k=[], v=[], pages=None, paged=""))
