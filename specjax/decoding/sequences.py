"""Per-row sequence state shared by every decode loop, and the prefill that starts it.

Invariant after prefill and after every step: `tokens[b, :length[b]]` are the committed tokens (prompt
then generated), the cache holds K/V for slots `0 .. length[b] - 2`, and `tokens[b, length[b] - 1]` is
the *pending* token: chosen, not yet fed to the target. A step feeds the pending token (plus drafts) and
commits one or more new tokens. Everything past `length` is scratch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, read_rows, write_rows
from specjax.models.params import ModelParams
from specjax.models.target import init_target_cache, target_forward, target_logits
from specjax.sampling import SamplingConfig, choose_token, top2_margin
from specjax.rounding import exact_jit


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sequences:
    tokens: jax.Array  # [B, S] int32
    length: jax.Array  # [B] int32, committed tokens including the pending one
    prompt_len: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    margins: jax.Array  # [B, S] float32: top-1 minus top-2 target logit behind each generated token

    def pending(self) -> jax.Array:
        return jnp.take_along_axis(self.tokens, (self.length - 1)[:, None], axis=1)[:, 0]


def num_slots_for(prompt_bucket: int, max_new_tokens: int, k: int) -> int:
    """Cache/token-buffer size: room for the prompt, the output and one step's overshoot of k + 1
    (drafts are written past the final length before being judged). Rounded up to 64 slots."""
    need = prompt_bucket + max_new_tokens + 2 * (k + 1)
    return -(-need // 64) * 64


def prompt_bucket(max_prompt_len: int) -> int:
    """Prompt lengths are padded to a power of two (>= 16) so few shapes get compiled."""
    return max(16, 1 << (max_prompt_len - 1).bit_length())


def stop_hit(tokens, lo, hi, stop_tokens: tuple[int, ...]) -> jax.Array:
    """[B] bool: is any stop token among tokens[b, lo[b]:hi[b]]?"""
    if not stop_tokens:
        return jnp.zeros(tokens.shape[0], bool)
    idx = jnp.arange(tokens.shape[1])[None, :]
    in_range = (idx >= lo[:, None]) & (idx < hi[:, None])
    is_stop = jnp.isin(tokens, jnp.asarray(stop_tokens, tokens.dtype))
    return jnp.any(in_range & is_stop, axis=1)


def commit(seqs: Sequences, new_tokens: jax.Array, num_new: jax.Array, gen: GenerationConfig,
           margins: jax.Array | None = None, limit: jax.Array | None = None,
           max_new: jax.Array | None = None) -> Sequences:
    """Append new_tokens[b, :num_new[b]] to each row that is not done; then update `done`.

    `limit` [B] (forcing mode) replaces the max-new-tokens rule: a row is done at that length.
    `max_new` [B] (batched serving): per-row max new tokens instead of `gen.max_new_tokens`.
    """
    active = ~seqs.done
    num_new = jnp.where(active, num_new, 0)
    start = seqs.length
    tokens = write_rows(seqs.tokens, new_tokens, start)
    tokens = jnp.where(active[:, None], tokens, seqs.tokens)
    if margins is not None:
        m = write_rows(seqs.margins, margins, start)
        margins = jnp.where(active[:, None], m, seqs.margins)
    else:
        margins = seqs.margins
    length = start + num_new
    if limit is None:
        cap = gen.max_new_tokens if max_new is None else max_new
        finished = (length - seqs.prompt_len >= cap) | stop_hit(
            tokens, start, length, gen.stop_tokens)
    else:
        finished = length >= limit
    return Sequences(tokens=tokens, length=length, prompt_len=seqs.prompt_len,
                     done=seqs.done | finished, margins=margins)


def prompt_forward(params: ModelParams, cfg: ModelConfig, prompt: jax.Array, prompt_len: jax.Array,
                   taps: tuple[int, ...] = ()) -> tuple:
    """The target over the (right-padded) prompts, in a cache of exactly P slots.

    Returns (cache [P slots], each row's last-prompt-token logits [B, V], tapped hidden states over
    the prompt [B, P, len(taps) * D] for block drafters, None without `taps`). Padding slots get
    K/V too; they sit past `length` and are overwritten before they could be read. A hybrid
    target's recurrent layers see each row's real tokens only. Nothing here depends on the
    decoder (k, slot count, drafter), so `prompt_pass` runs it as one program that AR and every
    speculative decoder share.
    """
    B, P = prompt.shape
    cache = init_target_cache(cfg, B, P)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    hidden, features, cache = target_forward(params, cfg, prompt, positions, cache,
                                             jnp.zeros(B, jnp.int32), taps, valid=prompt_len)
    last = jnp.take_along_axis(hidden, (prompt_len - 1)[:, None, None], axis=1)[:, 0]
    return cache, target_logits(params, cfg, last), features


# One compiled program for the prompt whichever decoder runs next: when AR and a speculative
# decoder each compile their own prefill (other slot counts, a drafter's init beside it), XLA may
# build the prompt's GEMMs differently in each (it autotunes per program; prompts over 1024 rows
# leave our kernels), and in bf16 the prompt's K/V could then differ in the last bits, enough to
# flip a near-tie token between AR and speculative runs (docs/notes/perf.md, 2026-12-06).
prompt_pass = exact_jit(prompt_forward, static_argnames=("cfg", "taps"))


def grow_cache(cache, num_slots: int):
    """A cache's K/V [B, S, H, hd] padded with zero slots to `num_slots` (recurrent state as is)."""
    extra = num_slots - cache.k[0].shape[1] if cache.k else 0
    if extra < 0:
        raise ValueError(f"cannot shrink a {cache.k[0].shape[1]}-slot cache to {num_slots} slots")
    if extra == 0:
        return cache
    pad = lambda a: jnp.pad(a, ((0, 0), (0, extra), (0, 0), (0, 0)))
    return dataclasses.replace(cache, k=[pad(a) for a in cache.k], v=[pad(a) for a in cache.v])


def start_sequences(gen: GenerationConfig, cache, logits: jax.Array, prompt: jax.Array,
                    prompt_len: jax.Array, num_slots: int, key: jax.Array):
    """After the prompt pass: the cache grown to `num_slots`, each row's first token chosen and
    committed -> (cache, sequences)."""
    B, P = prompt.shape
    first = choose_token(logits, gen.sampling, key)
    tokens = jnp.zeros((B, num_slots), jnp.int32).at[:, :P].set(prompt)
    seqs = Sequences(tokens=tokens, length=prompt_len, prompt_len=prompt_len,
                     done=jnp.zeros(B, bool), margins=jnp.full((B, num_slots), jnp.inf, jnp.float32))
    seqs = commit(seqs, first[:, None], jnp.ones(B, jnp.int32), gen, margins=top2_margin(logits)[:, None])
    return grow_cache(cache, num_slots), seqs


def prefill(params: ModelParams, cfg: ModelConfig, gen: GenerationConfig, prompt: jax.Array,
            prompt_len: jax.Array, num_slots: int, key: jax.Array, taps: tuple[int, ...] = ()
            ) -> tuple[KVCache, Sequences, jax.Array, jax.Array | None]:
    """`prompt_forward` then `start_sequences`, inline (for callers inside one jit).

    Returns (cache, sequences, first-token logits [B, V], tapped features or None)."""
    cache, logits, features = prompt_forward(params, cfg, prompt, prompt_len, taps)
    cache, seqs = start_sequences(gen, cache, logits, prompt, prompt_len, num_slots, key)
    return cache, seqs, logits, features


__all__ = ["GenerationConfig", "Sequences", "prefill", "prompt_forward", "prompt_pass", "start_sequences",
           "grow_cache", "commit", "num_slots_for", "prompt_bucket",
           "stop_hit", "read_rows"]
