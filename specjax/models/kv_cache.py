"""A dense KV cache with a static number of slots per row.

Slot j of row b holds the key/value of the token at sequence index j. Each row has its own fill level,
so rows of one batch can be at different lengths (different prompts, different acceptance). Writes go
to contiguous slots starting at a per-row index; nothing past a row's length is ever read unmasked, so
rejected drafts need no cleanup: their slots are overwritten by the next step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, S, Hkv, hd]
    v: list[jax.Array]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, num_slots: int) -> KVCache:
    shape = (batch, num_slots, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    return KVCache(k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
                   v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)])


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, S, ...], new [B, T, ...], start [B]: buf[b, start[b]:start[b]+T] = new[b].

    The caller guarantees start + T <= S (dynamic_update_slice would clamp, silently shifting).
    """
    def one(row, upd, s):
        return jax.lax.dynamic_update_slice_in_dim(row, upd, s, axis=0)
    return jax.vmap(one)(buf, new.astype(buf.dtype), start)


def read_rows(buf: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """buf [B, S, ...] -> buf[b, start[b]:start[b]+width] as [B, width, ...]."""
    def one(row, s):
        return jax.lax.dynamic_slice_in_dim(row, s, width, axis=0)
    return jax.vmap(one)(buf, start)
