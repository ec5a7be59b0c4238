"""Ragged paged attention for continuous batching: every block-table row's new tokens attend over
that row's own pages, read through its block table, with no gathered copy of the cache.

The serving engine's XLA path (`serving/flat_forward.py`) gathers each row's pages into an
[R, P * page_size] view per layer before attending; at batch 32 on the 8B shape that gather and
the masked softmax over the whole view were most of a step's fixed cost
(docs/results/serving_h200.md). Here one Pallas kernel per layer reads each row's live pages once:

- rows: for each KV head, the row's W * G query rows (W token columns, G query heads per KV head,
  row = w * G + g), in chunks of 16 (one tensor-core dot of [16, head_dim] x [head_dim, page_size]
  per page);
- grid (block-table rows, KV heads, row chunks, splits): a row's page list is cut into splits of
  `pages_per_split` pages, each a program running an online softmax over its pages, stopping at
  the row's last live page (flash-decoding: enough programs to stream at batch 1);
- masks are positional and ragged: a query at position p sees the row's positions <= p, and no
  position at or past the row's `kv_len` (pages are reused: past it a page holds another request's
  leftovers, possibly NaN, so V is zeroed there: 0 * NaN would poison the sum);
- the splits' (max, sum, output) partials are combined in XLA in split order
  (`decode_attention.combine_splits`).

`pages_per_split` is numerics; `num_warps` and `num_stages` are speed only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import MASKED, ROWS, _compiler_params, combine_splits


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tuning config of `paged_attention`."""

    pages_per_split: int = 8  # pages per program (numerics: where the splits cut)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.pages_per_split < 1:
            raise ValueError(f"pages_per_split must be >= 1, got {self.pages_per_split}")


def _kernel(q_ref, k_ref, v_ref, pages_ref, qpos_ref, kv_len_ref, o_ref, m_ref, l_ref, *,
            cfg: PagedAttentionConfig, page_size: int, scale: float):
    r, h, c, sp = (pl.program_id(i) for i in range(4))
    rows = pl.ds(pl.multiple_of(c * ROWS, ROWS), ROWS)
    q = q_ref[r, h, rows, :]
    qpos = qpos_ref[r, rows]  # [ROWS]; -1 on padding rows (nothing visible)
    kv_len = kv_len_ref[r]
    first = sp * cfg.pages_per_split
    live_pages = (kv_len + page_size - 1) // page_size
    count = jnp.clip(live_pages - first, 0, cfg.pages_per_split)

    def body(i, carry):
        o, m, l = carry
        j = first + i
        page = pages_ref[r, j]
        pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)
        k = k_ref[page, :, h, :]
        scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        visible = (pos[None, :] <= qpos[:, None]) & (pos[None, :] < kv_len)
        scores = jnp.where(visible, scores, MASKED)
        m_next = jnp.maximum(m, jnp.max(scores, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next[:, None])
        v = v_ref[page, :, h, :]
        v = jnp.where((pos < kv_len)[:, None], v, jnp.zeros_like(v))
        o = correction[:, None] * o + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_next, correction * l + jnp.sum(p, axis=1)

    hd = q.shape[-1]
    init = (jnp.zeros((ROWS, hd), jnp.float32), jnp.full((ROWS,), MASKED, jnp.float32),
            jnp.zeros((ROWS,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, count, body, init)
    o_ref[r, h, sp, rows, :] = o
    m_ref[r, h, sp, rows] = m
    l_ref[r, h, sp, rows] = l


def check_shapes(q, k_pool, v_pool, pages, qpos, kv_len) -> None:
    R, W, Hq, hd = q.shape
    P, page_size, Hkv, _ = k_pool.shape
    problems = []
    if k_pool.shape != v_pool.shape or k_pool.shape[3] != hd:
        problems.append(f"pools {k_pool.shape}/{v_pool.shape} vs head_dim {hd}")
    if Hq % Hkv:
        problems.append(f"{Hq} query heads not a multiple of {Hkv} KV heads")
    if pages.shape[0] != R or qpos.shape != (R, W) or kv_len.shape != (R,):
        problems.append(f"block table {pages.shape}, qpos {qpos.shape}, kv_len {kv_len.shape} for {R} rows of {W}")
    if page_size < 16 or page_size & (page_size - 1):
        problems.append(f"page_size must be a power of two >= 16 (one tensor-core dot a page), got {page_size}")
    if problems:
        raise ValueError("paged_attention: " + "; ".join(problems))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array, qpos: jax.Array,
                    kv_len: jax.Array, config: PagedAttentionConfig = PagedAttentionConfig(),
                    interpret: bool = False) -> jax.Array:
    """q [R, W, Hq, hd] (block-table row r's tokens in columns), pools [num_pages, page_size, Hkv, hd],
    pages [R, P] int32 block table, qpos [R, W] int32 (each token's position; -1: no token),
    kv_len [R] int32 (positions >= kv_len[r] are never visible) -> [R, W, Hq * hd] in q's dtype."""
    check_shapes(q, k_pool, v_pool, pages, qpos, kv_len)
    R, W, Hq, hd = q.shape
    page_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    rows = W * G
    Rp = -(-rows // ROWS) * ROWS
    splits = -(-pages.shape[1] // config.pages_per_split)
    pad_pages = splits * config.pages_per_split - pages.shape[1]  # never read: past every live page
    pages = jnp.pad(pages.astype(jnp.int32), ((0, 0), (0, pad_pages)))
    qr = q.astype(k_pool.dtype).reshape(R, W, Hkv, G, hd).transpose(0, 2, 1, 3, 4).reshape(R, Hkv, rows, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - rows), (0, 0)))
    qp = jnp.broadcast_to(qpos[:, :, None], (R, W, G)).reshape(R, rows)
    qp = jnp.pad(qp.astype(jnp.int32), ((0, 0), (0, Rp - rows)), constant_values=-1)
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, cfg=config, page_size=page_size, scale=hd ** -0.5),
        out_shape=(jax.ShapeDtypeStruct((R, Hkv, splits, Rp, hd), f32),
                   jax.ShapeDtypeStruct((R, Hkv, splits, Rp), f32),
                   jax.ShapeDtypeStruct((R, Hkv, splits, Rp), f32)),
        grid=(R, Hkv, Rp // ROWS, splits),
        compiler_params=_compiler_params(config, interpret),
        interpret=interpret,
        name="paged_attention",
    )(qr, k_pool, v_pool, pages, qp, kv_len.astype(jnp.int32))
    out = combine_splits(o, m, l)
    # a row with no live position (kv_len 0: a block-table row with no token this step) sees
    # nothing: zeros, not 0 / 0
    out = jnp.where(jnp.all(l == 0, axis=2)[..., None], 0.0, out)[:, :, :rows]
    out = out.reshape(R, Hkv, W, G, hd).transpose(0, 2, 1, 3, 4).reshape(R, W, Hq * hd)
    return out.astype(q.dtype)


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                              qpos: jax.Array, kv_len: jax.Array) -> jax.Array:
    """What `paged_attention` computes, in plain JAX: each row's pages gathered into one view, one
    softmax over it (the serving engine's XLA path)."""
    R, W, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    view = lambda pool: pool[pages].reshape((R, -1) + pool.shape[2:])  # [R, S, Hkv, hd]
    k, v = view(k_pool), view(v_pool)
    pos = jnp.arange(k.shape[1])
    live = pos[None, :] < kv_len[:, None]  # [R, S]
    v = jnp.where(live[:, :, None, None], v, 0)
    visible = (pos[None, None, :] <= qpos[:, :, None]) & live[:, None, :]  # [R, W, S]
    qg = q.astype(k.dtype).reshape(R, W, Hkv, Hq // Hkv, hd)
    scores = jnp.einsum("rwkgd,rskd->rkgws", qg, k, preferred_element_type=jnp.float32) * hd ** -0.5
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))  # a row with no token sees nothing: zeros
    out = jnp.einsum("rkgws,rskd->rwkgd", probs, v.astype(jnp.float32))
    return out.reshape(R, W, Hq * hd).astype(q.dtype)
