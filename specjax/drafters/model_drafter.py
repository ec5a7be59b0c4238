"""Autoregressive drafting with a model of the target's vocabulary: a separate small model, or the
target's own first K layers with its final norm and head (layer-skip self-drafting, no training).

The drafter keeps its own KV cache with the target's slot layout. Each round starts with a width-2
forward over the last two committed tokens: the older one may be a fully accepted draft the drafter
never fed, the newer is the pending token whose logits give the first draft. Then k - 1 width-1
steps (a `lax.scan`, so compile time does not grow with k) produce the rest.
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
        keys = jax.random.split(key, self.k)
        first, q_first = _pick(lm_logits(self.params, hidden[:, 1]), sampling, keys[0])

        def step(carry, key_i):
            cache, token, pos = carry
            h, cache = forward(self.params, self.cfg, token[:, None], pos[:, None], cache, pos)
            nxt, q = _pick(lm_logits(self.params, h[:, 0]), sampling, key_i)
            return (cache, nxt, pos + 1), (nxt, q)

        (cache, _, _), (rest, q_rest) = jax.lax.scan(
            step, (cache, first, seqs.length), keys[1:])
        draft = jnp.concatenate([first[:, None], rest.T], axis=1)
        if sampling.greedy:
            return draft, None, cache
        q = jnp.concatenate([q_first[:, None], jnp.moveaxis(q_rest, 0, 1)], axis=1)
        return draft, q, cache


def layer_skip_drafter(target_params: ModelParams, target_cfg: ModelConfig, num_layers: int,
                       k: int) -> ModelDrafter:
    """Self-drafting with the target's first `num_layers` layers, sharing its weights."""
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
