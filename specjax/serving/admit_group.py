"""Admission: queued requests into free slots, several with one prefill forward (dense targets).

Every prefill reads all the target's weights: prefilling one request per forward was 30% of the
device time of every serving configuration at B = 32 with 64-token requests
(docs/results/serving_h200.md, 2026-12-07). `admit_group` prefills the queue's head requests that
fit (a free slot each and their pages, in queue order, as admitting them one at a time would
place them) together: their prompts are rows of one flat token bucket of `group` x P tokens
(P = the queue's prompt width). The group size is static (a jit shape); `step.admit` prefills
groups of `GROUP` while two or more requests can come in, then one at a time (group 1, which is
also how hybrid targets admit). Why 4: a prefill of G prompts of P tokens is weight-read-bound
only while G P is small (an 8B target turns compute-bound near 200 tokens on an H100), so past a
few rows a bigger group saves nothing over several groups of 4, costs more when only two
requests are waiting, and each size is one more compiled forward.

The prompt rows go through the same `flat_forward` as a single prefill, so a kernel target (whose
GEMMs and norms are row-invariant) computes the same bits either way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import GenerationConfig, stop_hit
from specjax.models.config import ModelConfig
from specjax.models.target import target_logits
from specjax.sampling import choose_token, top2_margin
from specjax.serving.flat_forward import flat_batch, flat_forward
from specjax.serving.hybrid_step import admit_hybrid
from specjax.serving.paged_cache import TRASH_PAGE, allocate, pages_needed
from specjax.serving.state import ServingState


GROUP = 4  # prompts per batched prefill forward (see the module docstring)


def reserve(plen, max_new, k: int):
    """Cache positions a request may write: prompt, output, one step's overshoot."""
    return plen + max_new + k + 1


def placements(st: ServingState, group: int, overshoot: int):
    """Which of the queue's first `group` requests are admitted, in order, and where: the same
    choices as admitting them one at a time (lowest free slot, lowest free pages; stop at the
    first request that does not fit). -> (ok [G] bool, slot [G] (B where not admitted), pages [G, M],
    new free-page mask)."""
    s, q = st.slots, st.queue
    B, M = s.busy.shape[0], s.pages.shape[1]
    page_size = st.cache.page_size

    def place(i, carry):
        free, busy, ok_prev, oks, slots, rows = carry
        need = pages_needed(reserve(q.length[i], q.max_new[i], overshoot), page_size)
        ok = ok_prev & (i < q.count) & ~jnp.all(busy) & (jnp.sum(free) >= need)
        row, taken = allocate(free, need, M)
        slot = jnp.argmin(busy)
        return (jnp.where(ok, taken, free), busy.at[slot].set(busy[slot] | ok), ok, oks.at[i].set(ok),
                slots.at[i].set(jnp.where(ok, slot, B)), rows.at[i].set(jnp.where(ok, row, TRASH_PAGE)))

    init = (st.free, s.busy, jnp.bool_(True), jnp.zeros(group, bool), jnp.full(group, B, jnp.int32),
            jnp.full((group, M), TRASH_PAGE, jnp.int32))
    free, _, _, ok, slot, rows = jax.lax.fori_loop(0, group, place, init)
    return ok, slot, rows, free


def admit_group(params, cfg: ModelConfig, drafter, gen: GenerationConfig, forcing: bool, overshoot: int,
                group: int, st: ServingState) -> ServingState:
    """Prefill up to `group` of the queue's head requests in one forward into free slots (group 1:
    one-by-one admission, hybrid targets included; the caller checked that the head fits).
    overshoot: positions one verify step writes past the committed length (`ServingOptions.overshoot`)."""
    s, q = st.slots, st.queue
    ok, slot, rows, free = placements(st, group, overshoot)
    G, P, L = group, q.tokens.shape[1], s.seqs.tokens.shape[1]
    prompt, plen, max_new = q.tokens[:G], q.length[:G], q.max_new[:G]
    idx = jnp.arange(P, dtype=jnp.int32)
    live = (idx[None, :] < plen[:, None]) & ok[:, None]  # [G, P]
    batch = flat_batch(prompt.reshape(-1), jnp.tile(idx, G), jnp.repeat(jnp.arange(G, dtype=jnp.int32), P),
                       jnp.tile(idx, G), live.reshape(-1), G, P)
    taps = getattr(drafter, "taps", ())
    recurrent = st.recurrent
    if recurrent is None:
        hidden, features, cache = flat_forward(params, cfg, batch, rows, st.cache, taps)
        logits = target_logits(params, cfg, hidden[jnp.arange(G) * P + jnp.maximum(plen - 1, 0)])  # [G, V]
        features = None if features is None else features.reshape(G, P, -1)
    else:  # a hybrid target, one request: the decoder's prompt forward, its GDN states into the slot
        if G != 1:
            raise ValueError(f"hybrid targets admit one request per prefill, not {G}")
        logits, features, cache, recurrent = admit_hybrid(params, cfg, prompt[0], plen[0], rows[0], slot[0], st, taps)
    key, sub = jax.random.split(st.key)
    first = choose_token(logits, gen.sampling, sub)
    failed = ~jnp.all(jnp.isfinite(logits), axis=-1)
    rg = jnp.arange(G)
    tokens = jnp.zeros((G, L), jnp.int32).at[:, :P].set(jnp.where(idx[None, :] < plen[:, None], prompt, 0))
    tokens = tokens.at[rg, plen].set(first)
    forced = s.forced
    if forcing:
        ref = q.ref_tokens[:G]
        at_plen = jnp.zeros((G, L), bool).at[rg, plen].set(True)
        new_forced = dataclasses.replace(
            forced, ref_tokens=ref, ref_length=q.ref_length[:G], mismatch=at_plen & (first != ref[rg, plen])[:, None],
            engine_token=jnp.where(at_plen, first[:, None], 0), checked=at_plen)
        forced = jax.tree.map(lambda full, new: full.at[slot].set(new, mode="drop"), forced, new_forced)
        tokens = tokens.at[rg, plen].set(ref[rg, plen])
        done = plen + 1 >= q.ref_length[:G]
    else:
        done = (max_new <= 1) | stop_hit(tokens, plen, plen + 1, gen.stop_tokens)

    def put(full, new):
        return full.at[slot].set(new, mode="drop")
    margins = jnp.full((G, L), jnp.inf).at[rg, plen].set(top2_margin(logits))
    seqs = dataclasses.replace(
        s.seqs, tokens=put(s.seqs.tokens, tokens), length=put(s.seqs.length, plen + 1),
        prompt_len=put(s.seqs.prompt_len, plen), done=put(s.seqs.done, done | failed),
        margins=put(s.seqs.margins, margins))
    dstate = st.dstate
    if drafter is not None:
        extra = {"features": features} if taps else {}
        dstate = jax.tree.map(put, dstate, drafter.init(prompt, plen, L, **extra))
    slots = dataclasses.replace(
        s, seqs=seqs, busy=put(s.busy, jnp.ones(G, bool)), rid=put(s.rid, q.rid[:G]),
        max_new=put(s.max_new, max_new), pages=put(s.pages, rows),
        accept_rate=put(s.accept_rate, jnp.full(G, 0.5, s.accept_rate.dtype)),
        rounds=put(s.rounds, jnp.zeros(G, jnp.int32)), committed=put(s.committed, jnp.zeros(G, jnp.int32)),
        accepted_hist=put(s.accepted_hist, jnp.zeros((G,) + s.accepted_hist.shape[1:], jnp.int32)),
        failed=put(s.failed, failed), forced=forced)
    n = jnp.sum(ok).astype(jnp.int32)
    order = jnp.argsort(jnp.arange(q.rid.shape[0]) < n, stable=True)  # the admitted head to the back
    queue = dataclasses.replace(q, **{f.name: getattr(q, f.name)[order] for f in dataclasses.fields(q)
                                      if f.name != "count"}, count=jnp.maximum(q.count - n, 0))
    return dataclasses.replace(st, slots=slots, cache=cache, free=free, dstate=dstate, queue=queue, key=key,
                               recurrent=recurrent)
