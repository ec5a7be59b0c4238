"""Autoregressive drafting with a model of the target's vocabulary: a separate small model, or the
target's own first K layers with its final norm and head (layer-skip self-drafting, no training).

The drafter keeps its own KV cache with the target's slot layout. Each round starts with a width-2
forward over the last two committed tokens: the older one may be a fully accepted draft the drafter
never fed, the newer is the pending token whose logits give the first draft. Then k - 1 width-1
steps (a `lax.scan`, so compile time does not grow with k) produce the rest. For tree verification
(`propose_logits`) the catch-up forward is k + 1 wide: an accepted path may leave the chain.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import Sequences
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache, read_rows
from specjax.models.params import ModelParams, truncate_layers
from specjax.models.transformer import forward, lm_logits
from specjax.sampling import SamplingConfig, probabilities, sample_from


def _pick(logits, sampling: SamplingConfig, key):
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    q = probabilities(logits, sampling)
    return sample_from(q, key), q


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    params: ModelParams
    cfg: ModelConfig = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        if self.k < 1:
            raise ConfigError(f"k must be >= 1, got {self.k}")

    def init(self, prompt, prompt_len, num_slots):
        B, P = prompt.shape
        cache = init_cache(self.cfg, B, num_slots)
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        _, cache = forward(self.params, self.cfg, prompt, positions, cache, jnp.zeros(B, jnp.int32))
        return cache

    def propose(self, cache, seqs: Sequences, key, sampling: SamplingConfig):
        start = seqs.length - 2
        last_two = read_rows(seqs.tokens, start, 2)
        positions = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
        hidden, cache = forward(self.params, self.cfg, last_two, positions, cache, start)
        draft, _, q, cache = self._extend(cache, lm_logits(self.params, hidden[:, 1]), seqs.length,
                                          key, sampling, keep_logits=False)
        return draft, q, cache

    def propose_logits(self, cache, seqs: Sequences):
        """For tree verification: the greedy chain [B, k], the float32 logits [B, k, V] it was drafted
        from (position d's, given the chain before it), and the cache.

        A tree may accept a path off the drafter's chain, so the catch-up forward re-feeds the last
        k + 1 committed tokens, not two: every slot a step can commit (up to k drafts and the
        target's token) is rewritten from the committed tokens before it is read. Rows shorter than
        k + 1 re-feed from slot 0; the window's slots past the committed length are overwritten by the
        drafts before any read (causal)."""
        width = self.k + 1
        start = jnp.maximum(seqs.length - width, 0)
        window = read_rows(seqs.tokens, start, width)
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        hidden, cache = forward(self.params, self.cfg, window, positions, cache, start)
        last = jnp.take_along_axis(hidden, (seqs.length - 1 - start)[:, None, None], axis=1)[:, 0]
        draft, logits, _, cache = self._extend(cache, lm_logits(self.params, last), seqs.length,
                                               jax.random.PRNGKey(0), SamplingConfig(), keep_logits=True)
        return draft, logits, cache

    def _extend(self, cache, first_logits, length, key, sampling: SamplingConfig, keep_logits: bool):
        """The first draft from `first_logits` (after the pending token at slot length - 1), then
        k - 1 width-1 steps -> (draft [B, k], float32 logits [B, k, V] (None unless keep_logits: a
        chain step needs only the draft probs), draft probs [B, k, V] (None when greedy), cache)."""
        keys = jax.random.split(key, self.k)
        first_logits = first_logits.astype(jnp.float32)
        first, q_first = _pick(first_logits, sampling, keys[0])

        def step(carry, key_i):
            cache, token, pos = carry
            h, cache = forward(self.params, self.cfg, token[:, None], pos[:, None], cache, pos)
            logits = lm_logits(self.params, h[:, 0]).astype(jnp.float32)
            nxt, q = _pick(logits, sampling, key_i)
            return (cache, nxt, pos + 1), (nxt, logits if keep_logits else None, q)

        (cache, _, _), (rest, logits_rest, q_rest) = jax.lax.scan(step, (cache, first, length), keys[1:])
        draft = jnp.concatenate([first[:, None], rest.T], axis=1)
        logits = None
        if keep_logits:
            logits = jnp.concatenate([first_logits[:, None], jnp.moveaxis(logits_rest, 0, 1)], axis=1)
        if sampling.greedy:
            return draft, logits, None, cache
        q = jnp.concatenate([q_first[:, None], jnp.moveaxis(q_rest, 0, 1)], axis=1)
        return draft, logits, q, cache


def layer_skip_drafter(target_params: ModelParams, target_cfg: ModelConfig, num_layers: int,
                       k: int) -> ModelDrafter:
    """Self-drafting with the target's first `num_layers` layers, sharing its weights."""
    if not isinstance(target_cfg, ModelConfig):
        raise NotImplementedError("layer-skip self-drafting needs a dense target; for a hybrid recurrent "
                                  "target use an n-gram, block or separate small-model drafter")
    if not 1 <= num_layers <= target_cfg.num_layers:
        raise ConfigError(f"layerskip:K needs 1 <= K <= {target_cfg.num_layers} (the target's layers), "
                          f"got {num_layers}")
    return ModelDrafter(truncate_layers(target_params, num_layers), target_cfg.with_layers(num_layers), k)


def small_model_drafter(params: ModelParams, cfg: ModelConfig, target_cfg: ModelConfig, k: int,
                        name: str = "drafter") -> ModelDrafter:
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"drafter {name}: vocabulary size {cfg.vocab_size} does not match the "
                          f"target's {target_cfg.vocab_size}")
    return ModelDrafter(params, cfg, k)
