"""Plain autoregressive decoding: the baseline every mechanism must reproduce token for token.

A gpt-fast-sized loop: prefill, then one target forward per token inside `lax.while_loop`, so the
whole decode runs on the device with no host round trip per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import GenerationConfig, Sequences, commit, prefill, start_sequences
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.params import ModelParams
from specjax.models.target import target_forward, target_logits
from specjax.sampling import choose_token, top2_margin
from specjax.rounding import exact_jit


def ar_logits(params: ModelParams, cfg: ModelConfig, cache: KVCache, seqs: Sequences
              ) -> tuple[jax.Array, KVCache]:
    """The target's next-token logits [B, V] after each row's pending token, and the cache with it."""
    pos = seqs.length - 1  # slot of the pending token
    hidden, _, cache = target_forward(params, cfg, seqs.pending()[:, None], pos[:, None], cache, pos)
    return target_logits(params, cfg, hidden[:, 0]), cache


def ar_step(params: ModelParams, cfg: ModelConfig, gen: GenerationConfig, cache: KVCache,
            seqs: Sequences, key: jax.Array) -> tuple[KVCache, Sequences]:
    logits, cache = ar_logits(params, cfg, cache, seqs)
    token = choose_token(logits, gen.sampling, key)
    pos = seqs.length - 1
    seqs = commit(seqs, token[:, None], jnp.ones_like(pos), gen, margins=top2_margin(logits)[:, None])
    return cache, seqs


@functools.partial(exact_jit, static_argnames=("cfg", "gen", "num_slots"))
def ar_prefill(params, cfg, gen, prompt, prompt_len, key, num_slots):
    cache, seqs, _, _ = prefill(params, cfg, gen, prompt, prompt_len, num_slots, key)
    return cache, seqs


@functools.partial(exact_jit, static_argnames=("gen", "num_slots"))
def ar_start(gen, cache, logits, prompt, prompt_len, key, num_slots):
    """`ar_prefill` after a shared `prompt_pass` (what `Decoder` runs: see sequences.prompt_pass)."""
    return start_sequences(gen, cache, logits, prompt, prompt_len, num_slots, key)


@functools.partial(exact_jit, static_argnames=("cfg", "gen"))
def ar_decode(params, cfg, gen, cache, seqs, key):
    """Decode until every row is done. Returns (sequences, number of steps)."""
    def cond(carry):
        return ~jnp.all(carry[1].done)

    def body(carry):
        cache, seqs, key, steps = carry
        key, sub = jax.random.split(key)
        cache, seqs = ar_step(params, cfg, gen, cache, seqs, sub)
        return cache, seqs, key, steps + 1

    _, seqs, _, steps = jax.lax.while_loop(cond, body, (cache, seqs, key, jnp.int32(0)))
    return seqs, steps
