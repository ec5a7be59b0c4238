"""The dense target's forward over one flat bucket of tokens from many slots (continuous batching).

Each token carries a block-table row, a column (its place in that row's token list this step), a
sequence position and a validity bit. The GEMMs, norms and MLP run on the T packed tokens; only
attention regroups them: q is unpacked into [R, W] by the rows' token lists, each row's K/V are
read from its pages as an [R, S] view (or, with `attention="pallas"`, read in place by the ragged
paged attention kernel, `pallas_kernels/paged_attention.py`), and the result is packed back. The
layer code is the dense forward's own (`transformer.layer_with`), so the numerics are the same ops
on the same rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.tree_attention import tree_attention
from specjax.models.config import ModelConfig
from specjax.models.params import ModelParams
from specjax.models.rope import rope_cos_sin
from specjax.models.transformer import dense_attention, layer_with, rms_norm
from specjax.serving.paged_cache import PagedKVCache, gather_view, token_pages, write_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FlatBatch:
    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] sequence positions (RoPE and K/V position)
    row: jax.Array  # [T] block-table row
    col: jax.Array  # [T] column in the row's token list
    valid: jax.Array  # [T] bool: padding tokens write to the trash page and are never read
    unpack: jax.Array  # [R, W] flat index of (row, column); 0 where the row has no such token
    rope: jax.Array  # [T] RoPE positions: `positions` for chains; a tree node's depth below its root
    # trees: [R, A, A] the rows' whole trees (node j is node i or an ancestor of it; None: chains,
    # causal by position); column w is node col0 + w (a second verify level starts past node 0)
    ancestors: jax.Array | None = None
    col0: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def width(self) -> int:
        return self.unpack.shape[1]


def flat_batch(tokens, positions, row, col, valid, num_rows: int, width: int, rope=None,
               ancestors=None, col0: int = 0) -> FlatBatch:
    T = tokens.shape[0]
    r = jnp.where(valid, row, num_rows)  # out of range: dropped
    unpack = jnp.zeros((num_rows, width), jnp.int32).at[r, col].set(jnp.arange(T, dtype=jnp.int32),
                                                                     mode="drop")
    positions = positions.astype(jnp.int32)
    return FlatBatch(tokens.astype(jnp.int32), positions, row.astype(jnp.int32), col.astype(jnp.int32),
                     valid, unpack, positions if rope is None else rope.astype(jnp.int32), ancestors, col0)


def visibility(batch: FlatBatch, view_len: int) -> jax.Array:
    """[R, W, S] bool: what column w of row r attends to. Chains: the row's positions <= its own.
    Trees (node j of a row at position first + j, first = its root's): positions before the root
    and the positions of its ancestors (itself included)."""
    qpos = batch.positions[batch.unpack]  # [R, W]
    s = jnp.arange(view_len)[None, None, :]
    if batch.ancestors is None:
        return s <= qpos[:, :, None]
    rel = s - tree_root(batch)[:, None, None]
    W, A = batch.width, batch.ancestors.shape[-1]
    rows = batch.ancestors[:, batch.col0:batch.col0 + W]  # [R, W, A]: the columns' nodes
    node = jnp.take_along_axis(rows, jnp.broadcast_to(jnp.clip(rel, 0, A - 1), (qpos.shape[0], W, view_len)),
                               axis=2)
    return (rel < 0) | ((rel < A) & node)


def tree_root(batch: FlatBatch) -> jax.Array:
    """[R] each row's root position (column 0 is node col0, at root + col0; rows without tokens
    read another row's position, clamped so that a kernel never indexes below slot 0)."""
    return jnp.maximum(batch.positions[batch.unpack][:, 0] - batch.col0, 0)


def _kernel_attention(interpret: bool, batch: FlatBatch, q, k_view, v_view, mask, kv_len):
    """q [R, W, Hq, hd] over the rows' views: `decode_attention` (chains), or `tree_attention`
    (trees: each node's path gathered into AR's positions)."""
    if batch.ancestors is None:
        return decode_attention(q, k_view, v_view, mask, kv_len, interpret=interpret)
    A = batch.ancestors.shape[-1]
    depths = jnp.sum(batch.ancestors, axis=-1, dtype=jnp.int32) - 1  # [R, A]
    return tree_attention(q, k_view, v_view, tree_root(batch), batch.ancestors, jnp.maximum(depths, 0), A - 1,
                          interpret=interpret, first_node=batch.col0)


def _paged_kernel(interpret: bool, mesh, cfg: ModelConfig, q, kp, vp, pages, qcols, kv_len, *tree):
    """The ragged paged attention kernel (trees: root, ancestors), split by KV heads over a
    tensor-parallel mesh where the heads divide (`sharding/tp_attention.py`)."""
    from pallas_kernels.paged_attention import paged_attention
    from specjax.sharding.tp_attention import head_parallel, splits_heads

    def kernel(q, kp, vp, pages, qcols, kv_len, *tree):
        extra = dict(root=tree[0], ancestors=tree[1]) if tree else {}
        return paged_attention(q, kp, vp, pages, qcols, kv_len, interpret=interpret, **extra)
    if splits_heads(mesh, cfg.num_kv_heads):
        return head_parallel(kernel, mesh, q, kp, vp, pages, qcols, kv_len, *tree)
    return kernel(q, kp, vp, pages, qcols, kv_len, *tree)


def flat_forward(params: ModelParams, cfg: ModelConfig, batch: FlatBatch, pages: jax.Array,
                 cache: PagedKVCache, taps: tuple[int, ...] = (), attention: str = "xla"
                 ) -> tuple[jax.Array, jax.Array | None, PagedKVCache]:
    """-> (final-normed hidden [T, D], tapped residuals [T, len(taps) * D] or None, new cache).

    Causal within each row by position: the token at position p sees the row's positions <= p,
    which are either committed or written by this very call (a chain's tokens); a tree's node sees
    the positions before its root and its ancestors' (`visibility`)."""
    page, offset = token_pages(pages, batch.row, batch.positions, batch.valid, cache.page_size)
    qpos = batch.positions[batch.unpack]  # [R, W]
    view_len = pages.shape[1] * cache.page_size
    mask = visibility(batch, view_len)  # [R, W, S]
    # Pages are reused: past a row's last position this call writes, a view holds another
    # request's leftovers, possibly NaN from a failed one, and 0 * NaN = NaN in the weighted sum
    # over V even where the mask is 0. Zero V there, so one request cannot poison another.
    last = jnp.full(pages.shape[0], -1, jnp.int32).at[batch.row].max(
        jnp.where(batch.valid, batch.positions, -1))
    live = (jnp.arange(view_len)[None, :] <= last[:, None])[:, :, None, None]  # [R, S, 1, 1]
    if attention != "xla":  # the paged kernel: -1 marks columns without a token
        has = jnp.zeros(batch.unpack.shape, bool).at[jnp.where(batch.valid, batch.row, pages.shape[0]),
                                                      batch.col].set(True, mode="drop")
        qcols = jnp.where(has, qpos, -1)
        columns = None if batch.ancestors is None else \
            batch.ancestors[:, batch.col0:batch.col0 + batch.width]  # [R, W, A]
    cos, sin = rope_cos_sin(cfg, batch.rope[None])
    x = params.embed[batch.tokens][None]  # [1, T, D]
    new_k, new_v, tapped = [], [], {}
    for i, (p, kp, vp) in enumerate(zip(params.layers, cache.k, cache.v)):
        def attend(q, k, v, kp=kp, vp=vp):
            kp = write_tokens(kp, k[0], page, offset)
            vp = write_tokens(vp, v[0], page, offset)
            if attention != "xla":
                tree = () if batch.ancestors is None else (tree_root(batch), columns)
                mixed = _paged_kernel(attention == "interpret", params.mesh, cfg, q[0][batch.unpack], kp, vp,
                                      pages, qcols, last + 1, *tree)
                return mixed[batch.row, batch.col][None], (kp, vp)
            v_view = jnp.where(live, gather_view(vp, pages), 0)
            if params.attention == "xla":
                mixed = dense_attention(cfg, q[0][batch.unpack], gather_view(kp, pages), v_view,
                                        mask)  # [R, W, q_size]
            else:  # kernel weights: engine.Decoder's attention kernels over the view, so every
                # row rounds as that engine's AR step does (the view holds positions in order)
                mixed = _kernel_attention(params.attention == "interpret", batch, q[0][batch.unpack],
                                          gather_view(kp, pages), v_view, mask, last + 1)
            return mixed[batch.row, batch.col][None], (kp, vp)
        x, (kp, vp) = layer_with(cfg, p, x, cos, sin, attend, norm=params.norm)
        new_k.append(kp)
        new_v.append(vp)
        if i in taps:
            tapped[i] = x[0]
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps, params.norm)
    return x[0], features, PagedKVCache(k=new_k, v=new_v)
