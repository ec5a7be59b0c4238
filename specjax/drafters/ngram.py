"""Prompt-lookup (n-gram) drafting on the device: find the most recent earlier occurrence of the
last n committed tokens (n from max_n down to min_n) and propose the k tokens that followed it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import Sequences
from specjax.errors import ConfigError
from specjax.models.kv_cache import read_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    k: int = dataclasses.field(metadata=dict(static=True))
    max_n: int = dataclasses.field(default=3, metadata=dict(static=True))
    min_n: int = dataclasses.field(default=1, metadata=dict(static=True))

    def __post_init__(self):
        if self.k < 1:
            raise ConfigError(f"k must be >= 1, got {self.k}")
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"ngram sizes need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def init(self, prompt, prompt_len, num_slots):
        return ()

    def propose(self, state, seqs: Sequences, key, sampling):
        tokens, length = seqs.tokens, seqs.length
        B, S = tokens.shape
        best_start = jnp.full((B,), -1, jnp.int32)  # where the continuation begins
        for n in range(self.max_n, self.min_n - 1, -1):  # longer matches take precedence
            query = read_rows(tokens, jnp.maximum(length - n, 0), n)  # [B, n]
            num_windows = S - n + 1
            match = jnp.ones((B, num_windows), bool)
            for i in range(n):
                match &= tokens[:, i:i + num_windows] == query[:, i:i + 1]
            start = jnp.arange(num_windows)[None, :]
            # the window must end before the query itself begins, so a continuation token exists
            match &= (start + n < length[:, None]) & (length[:, None] >= n + 1)
            latest = jnp.max(jnp.where(match, start, -1), axis=1)
            found = latest >= 0
            best_start = jnp.where((best_start < 0) & found, latest + n, best_start)
        fallback = jnp.broadcast_to(seqs.pending()[:, None], (B, self.k))  # any guess is safe
        draft = read_rows(tokens, jnp.maximum(best_start, 0), self.k)
        draft = jnp.where((best_start >= 0)[:, None], draft, fallback)
        return draft.astype(jnp.int32), None, state
