"""Attention of a token tree's nodes over a dense KV cache, laid out as AR decoding lays it out.

During tree verification node i sits at slot start + i while its ancestors sit at their own node
slots, with siblings' slots (masked) in between. `decode_attention` under the tree's mask adds
the same terms as AR, but at other slots: its P·V dot and softmax sums reduce over blocks of
slots, and where a real term sits inside a block decides how the float additions pair, so the
result can differ from AR's in the last bits (and flip a near-tie token). Here each node instead
reads the slots AR would have when it decodes that token: the committed prefix [0, start), then
its path (root first, itself last) at slots start .. start + depth, gathered per slot from the node
slots. Every block then holds the same values at the same lanes as AR's T = 1 step at position
start + depth (same `block_s`, `split_s`, masks and kv_len), and a row's result never depends on
another row (one node's query heads per 16-row dot). On the CPU (interpret mode) every node equals
the AR step bit for bit; on an H100 (2026-12-07) the first version equalled it at 15 of 16 nodes,
and the mask is now read as decode_attention reads its own (docs/notes/perf.md): a GPU re-check
(`benchmarks/tree_attention_check.py`) is pending.

Grid (B, KV heads, nodes, splits): a program runs node i's G query heads (padded to 16 rows) over
one split of slots with `decode_attention`'s online softmax; the splits combine in the same order
(`combine_splits`). Cost: one program per node instead of one per 16 rows (trees are small).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import (ROWS, AttentionConfig, _compiler_params, combine_splits,
                                             online_softmax_block, online_softmax_init)


def _kernel(q_ref, k_ref, v_ref, path_ref, mask_ref, kv_len_ref, start_ref, o_ref, m_ref, l_ref, *,
            cfg: AttentionConfig, scale: float, depth: int):
    b, h, i, sp = (pl.program_id(n) for n in range(4))
    bs = cfg.block_s
    q = q_ref[b, h, i, :, :]
    rows = pl.ds(pl.multiple_of(i * ROWS, ROWS), ROWS)
    start, kv_len = start_ref[b], kv_len_ref[b, i]
    lo = sp * cfg.split_s
    hi = jnp.minimum(lo + cfg.split_s, kv_len)
    nblocks = jnp.maximum(hi - lo + bs - 1, 0) // bs

    def body(n, carry):
        s0 = pl.multiple_of(lo + n * bs, bs)
        slots = s0 + jax.lax.broadcasted_iota(jnp.int32, (bs,), 0)
        rel = slots - start  # the path's depth a slot stands for (AR's layout)
        src = jnp.where(rel >= 0, path_ref[b, i, jnp.clip(rel, 0, depth)], slots)
        # read from memory as decode_attention reads its mask ([16, block_s] int8, padded rows all
        # masked), not computed here: the where/max/sum then take the same layouts on the GPU
        visible = mask_ref[b, rows, pl.ds(s0, bs)] != 0
        return online_softmax_block(q, k_ref[b, src, h, :], v_ref[b, src, h, :], visible, scale, carry)

    o, m, l = jax.lax.fori_loop(0, nblocks, body, online_softmax_init(q.shape[-1]))
    o_ref[b, h, i, sp, :, :] = o
    m_ref[b, h, i, sp, :] = m
    l_ref[b, h, i, sp, :] = l


def path_slots(ancestors: jax.Array, depths: jax.Array, start: jax.Array, max_depth: int) -> jax.Array:
    """ancestors [B, N, N] (node j is node i or an ancestor of it), depths [B, N], start [B]
    -> [B, N, max_depth + 1] int32: the slot of node i's ancestor at depth d (root first, node i
    at d = depth[i]); past depth[i]: node i's own slot (never visible)."""
    levels = jnp.arange(max_depth + 1)
    at = ancestors[:, :, None, :] & (depths[:, None, None, :] == levels[None, None, :, None])  # [B,N,D+1,N]
    own = jnp.arange(ancestors.shape[1])[None, :, None]
    node = jnp.where(jnp.any(at, -1), jnp.argmax(at, -1), own)
    return (start[:, None, None] + node).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("max_depth", "config", "interpret", "first_node"))
def tree_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array,
                   ancestors: jax.Array, depths: jax.Array, max_depth: int,
                   config: AttentionConfig = AttentionConfig(), interpret: bool = False,
                   first_node: int = 0) -> jax.Array:
    """q [B, N, Hq, hd] of nodes first_node .. first_node + N - 1 of trees of A nodes at slots
    start + node, caches [B, S, Hkv, hd], start [B], ancestors [B, A, A], depths [B, A]
    (<= max_depth) -> [B, N, Hq * hd] in q's dtype: each node attends to slots < start and its
    path, as AR at position start + its depth would. A slice of the nodes (first_node > 0) is a
    second verify level whose ancestors' K/V the first level already wrote."""
    B, N, Hq, hd = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    A = ancestors.shape[-1]
    if (Hq % Hkv or k_cache.shape != v_cache.shape or ancestors.shape != (B, A, A) or depths.shape != (B, A)
            or first_node + N > A):
        raise ValueError(f"tree_attention: q {q.shape} from node {first_node}, caches {k_cache.shape}/"
                         f"{v_cache.shape}, ancestors {ancestors.shape}, depths {depths.shape}")
    G = Hq // Hkv
    if G > ROWS:
        raise ValueError(f"tree_attention: {G} query heads per KV head; at most {ROWS}")
    if S % config.block_s:
        pad = config.block_s - S % config.block_s
        k_cache, v_cache = (jnp.pad(c, ((0, 0), (0, pad), (0, 0), (0, 0))) for c in (k_cache, v_cache))
        S += pad
    splits = -(-S // config.split_s)
    qr = q.astype(k_cache.dtype).reshape(B, N, Hkv, G, hd).transpose(0, 2, 1, 3, 4)  # [B, Hkv, N, G, hd]
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, ROWS - G), (0, 0)))
    paths = path_slots(ancestors, depths, start, max_depth)[:, first_node:first_node + N]
    depths = depths[:, first_node:first_node + N]
    kv_len = jnp.minimum(start[:, None] + depths + 1, S).astype(jnp.int32)  # AR's at start + depth
    # per node, 16 rows over the (virtual) slots: its G heads see slots < kv_len, padded rows nothing
    real = jnp.arange(ROWS)[None, None, :, None] < G
    mrows = (real & (jnp.arange(S)[None, None, None, :] < kv_len[:, :, None, None])).astype(jnp.int8)
    mrows = mrows.reshape(B, N * ROWS, S)
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, cfg=config, scale=hd ** -0.5, depth=max_depth),
        out_shape=(jax.ShapeDtypeStruct((B, Hkv, N, splits, ROWS, hd), f32),
                   jax.ShapeDtypeStruct((B, Hkv, N, splits, ROWS), f32),
                   jax.ShapeDtypeStruct((B, Hkv, N, splits, ROWS), f32)),
        grid=(B, Hkv, N, splits),
        compiler_params=_compiler_params(config, interpret),
        interpret=interpret,
        name="tree_attention",
    )(qr, k_cache, v_cache, paths, mrows, kv_len, start.astype(jnp.int32))
    out = combine_splits(o.reshape(B, Hkv * N, splits, ROWS, hd), m.reshape(B, Hkv * N, splits, ROWS),
                         l.reshape(B, Hkv * N, splits, ROWS))  # [B, Hkv * N, ROWS, hd]
    out = out.reshape(B, Hkv, N, ROWS, hd)[:, :, :, :G].transpose(0, 2, 1, 3, 4)
    return out.reshape(B, N, Hq * hd).astype(q.dtype)


def tree_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array,
                             ancestors: jax.Array, depths: jax.Array, max_depth: int) -> jax.Array:
    """What `tree_attention` computes, in plain JAX: node i over slots < start and its path."""
    from pallas_kernels.decode_attention import decode_attention_reference
    S = k_cache.shape[1]
    N = q.shape[1]
    rel = jnp.arange(S)[None, None, :] - start[:, None, None]
    node = jnp.take_along_axis(ancestors, jnp.broadcast_to(jnp.clip(rel, 0, N - 1), (q.shape[0], N, S)), axis=2)
    mask = (rel < 0) | ((rel < N) & node)
    return decode_attention_reference(q, k_cache, v_cache, mask)
