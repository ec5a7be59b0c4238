"""Ragged paged attention for continuous batching: every block-table row's new tokens attend over
that row's own pages, read through its block table, with no gathered copy of the cache.

The serving engine's XLA path (`serving/flat_forward.py`) gathers each row's pages into an
[R, P * page_size] view per layer before attending; at batch 32 on the 8B shape that gather and
the masked softmax over the whole view were most of a step's fixed cost
(docs/results/serving_h200.md). Here one Pallas kernel per layer reads each row's live pages once:

- rows: for each KV head, the row's W * G query rows (W token columns, G query heads per KV head,
  row = w * G + g), in chunks of 16 (one tensor-core dot of [16, head_dim] x [head_dim, block_s]
  per block of positions);
- grid (block-table rows, KV heads, row chunks, splits): a row's positions are cut into splits of
  `split_s`, each a program running an online softmax over blocks of `block_s` positions, stopping
  at the row's `kv_len` (flash-decoding: enough programs to stream at batch 1). A block's K and V
  rows are gathered through a per-position table (page * page_size + offset), so a block spans
  pages. The blocks, the splits and the per-block arithmetic (`online_softmax_block`) are
  `decode_attention`'s, and so are the defaults: a served token's attention rounds exactly as the
  engine's AR step over a dense cache does (the H200 bench's forcing gate failed a page-at-a-time
  online softmax, 2026-12-07);
- masks are positional and ragged: a query at position p sees the row's positions <= p, and no
  position at or past the row's `kv_len` (pages are reused: past it a page holds another request's
  leftovers, possibly NaN, so V is zeroed there: 0 * NaN would poison the sum);
- tree masks inside a row's segment (tree verification): a node sees the positions before its
  root and, of the MAX_TREE positions from the root on, those of its ancestors (itself included),
  read from two 32-bit words per query row. A chain is the case root = p + 1 with no bits, so both
  run one mask rule: visible = (pos < limit) | bit(pos - limit), below kv_len;
- the splits' (max, sum, output) partials are combined in XLA in split order
  (`decode_attention.combine_splits`);
- `paged_attention_masked` takes `decode_attention`'s dense [R, W, S] mask instead and turns it
  into the same per-column rule (`mask_rules`): the hybrid target's forward, whose deferred-path
  rows precede a chain or tree, builds masks that way.

`block_s` and `split_s` are numerics; `num_warps` and `num_stages` are speed only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import (ROWS, AttentionConfig, _compiler_params, combine_splits,
                                             online_softmax_block, online_softmax_init)


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tuning config of `paged_attention`; the numerics default to `decode_attention`'s."""

    block_s: int = AttentionConfig.block_s  # positions per online-softmax step (numerics)
    split_s: int = AttentionConfig.split_s  # positions per program (numerics), a multiple of block_s
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1) or self.split_s % self.block_s:
            raise ValueError(f"block_s must be a power of two >= 16 dividing split_s: {self}")


def _kernel(q_ref, k_ref, v_ref, slots_ref, limit_ref, bits_ref, kv_len_ref, o_ref, m_ref, l_ref, *,
            cfg: PagedAttentionConfig, scale: float):
    r, h, c, sp = (pl.program_id(i) for i in range(4))
    bs = cfg.block_s
    rows = pl.ds(pl.multiple_of(c * ROWS, ROWS), ROWS)
    q = q_ref[r, h, rows, :]
    limit = limit_ref[r, rows]  # [ROWS]: positions below are visible (0 on padding rows)
    lo_bits, hi_bits = bits_ref[r, 0, rows], bits_ref[r, 1, rows]  # positions limit + 0..63
    kv_len = kv_len_ref[r]
    lo = sp * cfg.split_s
    hi = jnp.minimum(lo + cfg.split_s, kv_len)
    nblocks = jnp.maximum(hi - lo + bs - 1, 0) // bs

    def body(i, carry):
        s0 = pl.multiple_of(lo + i * bs, bs)
        pos = s0 + jnp.arange(bs, dtype=jnp.int32)
        slot = slots_ref[r, pl.ds(s0, bs)]  # [bs] rows of the flattened pools
        k = k_ref[slot, h, :]
        v = v_ref[slot, h, :]
        v = jnp.where((pos < kv_len)[:, None], v, jnp.zeros_like(v))
        rel = pos[None, :] - limit[:, None]  # [ROWS, bs]
        word = jnp.where(rel < 32, lo_bits[:, None], hi_bits[:, None])
        bit = (word >> jnp.clip(rel & 31, 0, 31)) & 1
        visible = ((rel < 0) | ((rel < MAX_TREE) & (bit == 1))) & (pos[None, :] < kv_len)
        return online_softmax_block(q, k, v, visible, scale, carry)

    o, m, l = jax.lax.fori_loop(0, nblocks, body, online_softmax_init(q.shape[-1]))
    o_ref[r, h, sp, rows, :] = o
    m_ref[r, h, sp, rows] = m
    l_ref[r, h, sp, rows] = l


MAX_TREE = 64  # tree positions a query's bit words cover (nodes past the root: 63)


def tree_bits(ancestors: jax.Array) -> jax.Array:
    """ancestors [R, W, A] bool (A <= MAX_TREE: column w sees node j of its row's tree) ->
    [R, 2, W] int32: bit j of word j // 32."""
    R, W, A = ancestors.shape
    a = jnp.pad(ancestors, ((0, 0), (0, 0), (0, MAX_TREE - A))).reshape(R, W, 2, 32).astype(jnp.uint32)
    words = jnp.sum(a << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)  # distinct bits
    return jax.lax.bitcast_convert_type(words, jnp.int32).transpose(0, 2, 1)


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
    if page_size < 1 or page_size & (page_size - 1):
        problems.append(f"page_size must be a power of two, got {page_size}")
    if problems:
        raise ValueError("paged_attention: " + "; ".join(problems))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array, qpos: jax.Array,
                    kv_len: jax.Array, config: PagedAttentionConfig = PagedAttentionConfig(),
                    interpret: bool = False, root: jax.Array | None = None,
                    ancestors: jax.Array | None = None) -> jax.Array:
    """q [R, W, Hq, hd] (block-table row r's tokens in columns), pools [num_pages, page_size, Hkv, hd],
    pages [R, P] int32 block table, qpos [R, W] int32 (each token's position; -1: no token),
    kv_len [R] int32 (positions >= kv_len[r] are never visible) -> [R, W, Hq * hd] in q's dtype.
    Trees: root [R] and ancestors [R, W, A] (A <= MAX_TREE): column w sees the positions before
    root[r] and root[r] + j where ancestors[r, w, j] (instead of the positions <= qpos)."""
    check_shapes(q, k_pool, v_pool, pages, qpos, kv_len)
    if (root is None) != (ancestors is None):
        raise ValueError("paged_attention: trees need both root and ancestors")
    if ancestors is not None and (ancestors.shape[:2] != qpos.shape or ancestors.shape[2] > MAX_TREE
                                  or root.shape != kv_len.shape):
        raise ValueError(f"paged_attention: ancestors {ancestors.shape} (at most {MAX_TREE} nodes), root "
                         f"{root.shape} for {qpos.shape} tokens")
    R, W = qpos.shape
    real = qpos >= 0
    if ancestors is None:  # a chain: positions <= qpos, no tree bits
        limit, bits = qpos + 1, jnp.zeros((R, 2, W), jnp.int32)
    else:
        limit = jnp.broadcast_to(root[:, None], (R, W))
        bits = jnp.where(real[:, None, :], tree_bits(ancestors), 0)
    limit = jnp.where(real, limit, 0).astype(jnp.int32)  # no token: nothing visible
    return _paged_call(q, k_pool, v_pool, pages, limit, bits, kv_len, config, interpret)


def mask_rules(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """mask [R, W, S] bool -> the kernel's rule for it, (limit [R, W], bits [R, 2, W]) int32:
    visible = position < limit, or bit (position - limit) set. limit is a column's first position
    not visible; the bits cover the MAX_TREE positions from there. Exact for every mask the engines
    build (a visible prefix, then at most MAX_TREE positions with a pattern: chains, trees of at
    most MAX_TREE nodes after the positions before their root, a deferred path's rows); a position
    visible further on would be dropped."""
    R, W, S = mask.shape
    limit = jnp.where(jnp.all(mask, axis=-1), S, jnp.argmin(mask, axis=-1)).astype(jnp.int32)
    at = limit[..., None] + jnp.arange(MAX_TREE, dtype=jnp.int32)  # [R, W, MAX_TREE]
    after = jnp.take_along_axis(mask, jnp.minimum(at, S - 1), axis=-1) & (at < S)
    return limit, tree_bits(after)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def paged_attention_masked(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                           mask: jax.Array, kv_len: jax.Array,
                           config: PagedAttentionConfig = PagedAttentionConfig(),
                           interpret: bool = False) -> jax.Array:
    """`decode_attention`'s interface over a paged cache: mask [R, W, S] bool over the rows'
    positions (S = P * page_size; of the shapes `mask_rules` takes) -> [R, W, Hq * hd]. The hybrid
    target's attention layers in the serving engine (`models/hybrid.py`), whose forward builds
    dense masks (a deferred path's rows ahead of a chain or tree)."""
    R, W = q.shape[:2]
    check_shapes(q, k_pool, v_pool, pages, jnp.zeros((R, W), jnp.int32), kv_len)
    if mask.shape != (R, W, pages.shape[1] * k_pool.shape[1]):
        raise ValueError(f"paged_attention_masked: mask {mask.shape} for {R} rows of {W} tokens over "
                         f"{pages.shape[1]} pages of {k_pool.shape[1]}")
    limit, bits = mask_rules(mask)
    return _paged_call(q, k_pool, v_pool, pages, limit, bits, kv_len, config, interpret)


def _paged_call(q, k_pool, v_pool, pages, limit, bits, kv_len, config: PagedAttentionConfig, interpret: bool):
    """The kernel on per-column rules: limit [R, W], bits [R, 2, W] (0 and 0: nothing visible)."""
    R, W, Hq, hd = q.shape
    page_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    rows = W * G
    Rp = -(-rows // ROWS) * ROWS
    S = pages.shape[1] * page_size
    splits = -(-S // config.split_s)
    # position -> row of the flattened pools; padding past the table is never visible (>= kv_len)
    slots = (pages.astype(jnp.int32)[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)).reshape(R, S)
    slots = jnp.pad(slots, ((0, 0), (0, splits * config.split_s - S)))
    flat = lambda pool: pool.reshape((-1,) + pool.shape[2:])  # [num_pages * page_size, Hkv, hd]
    qr = q.astype(k_pool.dtype).reshape(R, W, Hkv, G, hd).transpose(0, 2, 1, 3, 4).reshape(R, Hkv, rows, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - rows), (0, 0)))

    def per_row(x):  # [..., W] -> [..., Rp]: row w * G + g, padded rows see nothing
        x = jnp.broadcast_to(x[..., None], x.shape + (G,)).reshape(x.shape[:-1] + (rows,))
        return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, Rp - rows),))
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, cfg=config, scale=hd ** -0.5),
        out_shape=(jax.ShapeDtypeStruct((R, Hkv, splits, Rp, hd), f32),
                   jax.ShapeDtypeStruct((R, Hkv, splits, Rp), f32),
                   jax.ShapeDtypeStruct((R, Hkv, splits, Rp), f32)),
        grid=(R, Hkv, Rp // ROWS, splits),
        compiler_params=_compiler_params(config, interpret),
        interpret=interpret,
        name="paged_attention",
    )(qr, flat(k_pool), flat(v_pool), slots, per_row(limit), per_row(bits), kv_len.astype(jnp.int32))
    out = combine_splits(o, m, l)
    # a row with no live position (kv_len 0: a block-table row with no token this step) sees
    # nothing: zeros, not 0 / 0
    out = jnp.where(jnp.all(l == 0, axis=2)[..., None], 0.0, out)[:, :, :rows]
    out = out.reshape(R, Hkv, W, G, hd).transpose(0, 2, 1, 3, 4).reshape(R, W, Hq * hd)
    return out.astype(q.dtype)


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                              qpos: jax.Array, kv_len: jax.Array, root: jax.Array | None = None,
                              ancestors: jax.Array | None = None) -> jax.Array:
    """What `paged_attention` computes, in plain JAX: each row's pages gathered into one view, one
    softmax over it (the serving engine's XLA path)."""
    R, W, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    view = lambda pool: pool[pages].reshape((R, -1) + pool.shape[2:])  # [R, S, Hkv, hd]
    k, v = view(k_pool), view(v_pool)
    pos = jnp.arange(k.shape[1])
    live = pos[None, :] < kv_len[:, None]  # [R, S]
    v = jnp.where(live[:, :, None, None], v, 0)
    if ancestors is None:
        seen = pos[None, None, :] <= qpos[:, :, None]
    else:
        rel = pos[None, None, :] - root[:, None, None]  # [R, 1, S]
        A = ancestors.shape[2]
        node = jnp.take_along_axis(ancestors, jnp.broadcast_to(jnp.clip(rel, 0, A - 1), qpos.shape + (pos.shape[0],)),
                                   axis=2)
        seen = (rel < 0) | ((rel < A) & node)
    visible = seen & (qpos >= 0)[:, :, None] & live[:, None, :]  # [R, W, S]
    qg = q.astype(k.dtype).reshape(R, W, Hkv, Hq // Hkv, hd)
    scores = jnp.einsum("rwkgd,rskd->rkgws", qg, k, preferred_element_type=jnp.float32) * hd ** -0.5
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))  # a row with no token sees nothing: zeros
    out = jnp.einsum("rkgws,rskd->rwkgd", probs, v.astype(jnp.float32))
    return out.reshape(R, W, Hq * hd).astype(q.dtype)
