"""Prompt-lookup (n-gram) drafting on the device: find the most recent earlier occurrence of the
last n committed tokens (n from max_n down to min_n) and propose the k tokens that followed it.

For tree verification (`propose_logits`) the drafter also scores alternatives from its match
statistics: at depth d, how often each token followed every earlier occurrence of the suffix at
offset d (longer suffixes weigh more), plus a pinch of the context's token frequencies. The scores
are a deterministic function of the committed tokens, so any tree built from them is lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import Sequences
from specjax.errors import ConfigError
from specjax.models.kv_cache import read_rows

SUFFIX_WEIGHT = 4.0  # a match of n tokens counts SUFFIX_WEIGHT ** n times: longer contexts decide
UNSEEN_MASS = 1e-6  # a token never seen in the context: possible, far below any seen one


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    k: int = dataclasses.field(metadata=dict(static=True))
    max_n: int = dataclasses.field(default=3, metadata=dict(static=True))
    min_n: int = dataclasses.field(default=1, metadata=dict(static=True))
    vocab_size: int = dataclasses.field(default=0, metadata=dict(static=True))  # for propose_logits; 0: unknown

    def __post_init__(self):
        if self.k < 1:
            raise ConfigError(f"k must be >= 1, got {self.k}")
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"ngram sizes need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def init(self, prompt, prompt_len, num_slots):
        return ()

    def _matches(self, tokens, length, n: int) -> jax.Array:
        """[B, S - n + 1] bool: window w (tokens w .. w + n - 1) equals the last n committed tokens, and
        the token after it is committed (a continuation exists; the query itself has none)."""
        B, S = tokens.shape
        query = read_rows(tokens, jnp.maximum(length - n, 0), n)  # [B, n]
        num_windows = S - n + 1
        match = jnp.ones((B, num_windows), bool)
        for i in range(n):
            match &= tokens[:, i:i + num_windows] == query[:, i:i + 1]
        start = jnp.arange(num_windows)[None, :]
        return match & (start + n < length[:, None]) & (length[:, None] >= n + 1)

    def propose(self, state, seqs: Sequences, key, sampling):
        tokens, length = seqs.tokens, seqs.length
        B = tokens.shape[0]
        best_start = jnp.full((B,), -1, jnp.int32)  # where the continuation begins
        for n in range(self.max_n, self.min_n - 1, -1):  # longer matches take precedence
            match = self._matches(tokens, length, n)
            latest = jnp.max(jnp.where(match, jnp.arange(match.shape[1])[None, :], -1), axis=1)
            best_start = jnp.where((best_start < 0) & (latest >= 0), latest + n, best_start)
        fallback = jnp.broadcast_to(seqs.pending()[:, None], (B, self.k))  # any guess is safe
        draft = read_rows(tokens, jnp.maximum(best_start, 0), self.k)
        draft = jnp.where((best_start >= 0)[:, None], draft, fallback)
        return draft.astype(jnp.int32), None, state

    def propose_logits(self, state, seqs: Sequences):
        """-> (draft [B, k] as `propose`, scores [B, k, V] float32, state). Scores are log masses:
        at depth d, sum over n of SUFFIX_WEIGHT ** n x (occurrences of the n-token suffix followed,
        d tokens later, by the token), plus the token's share of the committed context, plus
        UNSEEN_MASS; the draft's own token gets twice the best mass, so it ranks first."""
        if self.vocab_size < 1:
            raise ConfigError("the n-gram drafter needs vocab_size to score tree alternatives")
        draft, _, state = self.propose(state, seqs, None, None)
        tokens, length = seqs.tokens, seqs.length
        B, S = tokens.shape
        rows = jnp.arange(B)[:, None, None]
        depth = jnp.arange(self.k)
        mass = jnp.zeros((B, self.k, self.vocab_size), jnp.float32)
        for n in range(self.max_n, self.min_n - 1, -1):
            match = self._matches(tokens, length, n)  # [B, W]
            after = jnp.arange(match.shape[1])[:, None] + n + depth[None, :]  # [W, k]: the token d later
            seen = match[:, :, None] & (after[None] < length[:, None, None])  # committed tokens only
            follower = tokens[:, jnp.minimum(after, S - 1)]  # [B, W, k]
            mass = mass.at[rows, depth[None, None, :], follower].add(SUFFIX_WEIGHT ** n * seen)
        committed = jnp.arange(S)[None, :] < length[:, None]
        share = jnp.zeros((B, self.vocab_size)).at[jnp.arange(B)[:, None], tokens].add(
            committed / length[:, None].astype(jnp.float32))
        mass = mass + share[:, None, :] + UNSEEN_MASS
        best = jnp.max(mass, axis=-1)
        mass = mass.at[rows[:, :, 0], depth[None, :], draft].set(2.0 * best)
        return draft, jnp.log(mass), state
