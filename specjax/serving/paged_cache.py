"""A paged KV cache: every layer's K/V live in one pool of fixed-size pages shared by all slots;
a block table row per slot lists its pages in sequence order (position p of a slot lives in page
`pages[slot, p // page_size]` at offset `p % page_size`).

Page 0 is the trash page: padding tokens write there and unused block-table entries point at it,
so a write never needs a branch and nothing real is ever overwritten. Pages are handed out and
returned on the device (`allocate`, `release`), so admission needs no host round trip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig

TRASH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    k: list[jax.Array]  # per layer [num_pages, page_size, Hkv, hd]
    v: list[jax.Array]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int) -> PagedKVCache:
    """A pool per attention layer (every layer of a dense target; a hybrid target's attention
    layers only)."""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    layers = len(cfg.attn_layers) if hasattr(cfg, "attn_layers") else cfg.num_layers
    return PagedKVCache(k=[jnp.zeros(shape, dtype) for _ in range(layers)],
                        v=[jnp.zeros(shape, dtype) for _ in range(layers)])


def scatter_view(pool: jax.Array, pages: jax.Array, view: jax.Array) -> jax.Array:
    """Inverse of `gather_view`: each row's [P * page_size, ...] positions back into its pages
    (rows' unused block-table entries all point at the trash page: whatever lands there is never
    read)."""
    R, P = pages.shape
    return pool.at[pages].set(view.reshape((R, P, pool.shape[1]) + pool.shape[2:]).astype(pool.dtype))


def token_pages(pages: jax.Array, row: jax.Array, positions: jax.Array, valid: jax.Array,
                page_size: int) -> tuple[jax.Array, jax.Array]:
    """Where each token's K/V go: pages [R, P] block table, row/positions/valid [T]
    -> (page [T], offset [T]); invalid tokens go to the trash page."""
    page = pages[row, positions // page_size]
    return jnp.where(valid, page, TRASH_PAGE), positions % page_size


def write_tokens(pool: jax.Array, new: jax.Array, page: jax.Array, offset: jax.Array) -> jax.Array:
    """pool [num_pages, page_size, ...], new [T, ...] -> pool with new[t] at (page[t], offset[t])."""
    return pool.at[page, offset].set(new.astype(pool.dtype))


def gather_view(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """pool [num_pages, page_size, ...], pages [R, P] -> each row's positions [R, P * page_size, ...]."""
    view = pool[pages]  # [R, P, page_size, ...]
    return view.reshape((pages.shape[0], pages.shape[1] * pool.shape[1]) + pool.shape[2:])


def pages_needed(num_tokens: jax.Array, page_size: int) -> jax.Array:
    return (num_tokens + page_size - 1) // page_size


def allocate(free: jax.Array, count: jax.Array, pages_per_slot: int) -> tuple[jax.Array, jax.Array]:
    """Take `count` free pages (the lowest-numbered): free [num_pages] bool, count scalar
    -> (block-table row [pages_per_slot] (unused entries: the trash page), new free mask).
    The caller checks that enough pages are free."""
    idx = jnp.nonzero(free, size=pages_per_slot, fill_value=TRASH_PAGE)[0].astype(jnp.int32)
    used = jnp.arange(pages_per_slot) < count
    row = jnp.where(used, idx, TRASH_PAGE)
    taken = jnp.where(used, idx, free.shape[0])  # out of range: dropped
    return row, free.at[taken].set(False, mode="drop")


def release(free: jax.Array, pages: jax.Array, rows: jax.Array) -> jax.Array:
    """Return the pages of the block-table rows where rows [R] is True (never the trash page)."""
    give = jnp.where(rows[:, None] & (pages != TRASH_PAGE), pages, free.shape[0])
    return free.at[give.reshape(-1)].set(True, mode="drop")
