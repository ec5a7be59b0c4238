"""The end of a serving verify step, chain or tree: mark slots whose logits were not finite as
failed, let token forcing replace what differs from the reference, commit each slot's accepted
tokens (its own max_new), and update the per-slot statistics (acceptance rate for the budget,
rounds, committed tokens, histogram)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.decoding.chain import force
from specjax.decoding.sequences import GenerationConfig, commit
from specjax.serving.state import Slots


def commit_round(s: Slots, out, num_accepted, margins, failed, active, n_drafts, reach,
                 gen: GenerationConfig, forcing: bool) -> Slots:
    """out [B, W] tokens (accepted drafts, then the target's own), num_accepted [B], margins
    [B, W]; n_drafts [B] drafts verified, reach [B] (>= 1) the most that could be accepted."""
    seqs = dataclasses.replace(s.seqs, done=s.seqs.done | failed)
    forced, ref_limit = s.forced, None
    if forcing:
        forced, out, num_accepted = force(forced, seqs, out, num_accepted)
        ref_limit = forced.ref_length
    before = seqs.length
    seqs = commit(seqs, out, num_accepted + 1, gen, margins=margins, limit=ref_limit, max_new=s.max_new)
    stepped = active & ~failed
    rate = jnp.where(stepped & (n_drafts > 0), 0.7 * s.accept_rate + 0.3 * num_accepted / reach, s.accept_rate)
    gained = jnp.where(stepped, seqs.length - before, 0)
    width = s.accepted_hist.shape[1]
    hist = s.accepted_hist + (stepped[:, None] & (jnp.arange(width)[None, :] == gained[:, None] - 1))
    return dataclasses.replace(s, seqs=seqs, accept_rate=rate, rounds=s.rounds + stepped,
                               committed=s.committed + gained, accepted_hist=hist,
                               failed=s.failed | failed, forced=forced)
