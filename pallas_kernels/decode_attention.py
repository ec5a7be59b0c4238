"""Attention of T new tokens over a dense KV cache (decode and verify steps): one fused kernel.

XLA runs the step's attention as several kernels per layer (two batched dots, the mask, the
softmax, transposes of the query); at T = 16 they cost ~0.4 ms of an 8B-shaped step
(docs/results/kernels_h200.md). Here one Pallas kernel per layer streams the cache once:

- rows: for each KV head, its T * G query rows (G = query heads per KV head, row = t * G + g),
  in chunks of 16 (one tensor-core dot of [16, head_dim] x [head_dim, block_s] per key block);
- grid (B, KV heads, row chunks, splits): the slots are cut into splits of `split_s`, each a
  program running an online softmax over blocks of `block_s` slots (flash-decoding: enough programs
  to stream the cache at bandwidth even at T = 1);
- the splits' (max, sum, output) partials are combined in XLA in split order.

A row's result does not depend on T: the dots are per 16-row chunk, each row's blocks and splits
are fixed slot ranges, and a block that is fully masked for a row leaves its state bitwise
unchanged (or is wiped by a zero correction), so an AR step and a verify step agree bit for bit.
`block_s` and `split_s` are numerics; `num_warps` and `num_stages` are speed only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 16  # query rows per tensor-core dot (mma.sync at every T)
MASKED = -1e30  # score of a masked slot: exp(MASKED - m) == 0 for any real score m


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tuning config of `decode_attention`."""

    block_s: int = 64  # key slots per inner step (numerics)
    split_s: int = 256  # key slots per program (numerics); a multiple of block_s
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s must be a power of two >= 16, got {self.block_s}")
        if self.split_s % self.block_s:
            raise ValueError(f"split_s ({self.split_s}) must be a multiple of block_s ({self.block_s})")


def online_softmax_init(hd: int):
    """(output, running max, running sum) of 16 rows before any block."""
    return (jnp.zeros((ROWS, hd), jnp.float32), jnp.full((ROWS,), MASKED, jnp.float32),
            jnp.zeros((ROWS,), jnp.float32))


def online_softmax_block(q, k, v, visible, scale: float, carry):
    """One block of slots into the online softmax of 16 query rows: q [16, hd], k/v [block_s, hd],
    visible [16 or 1, block_s]. Shared by this kernel and tree_attention.py, so both round alike."""
    o, m, l = carry
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible, scores, MASKED)
    m_next = jnp.maximum(m, jnp.max(scores, axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.exp(scores - m_next[:, None])
    o = correction[:, None] * o + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_next, correction * l + jnp.sum(p, axis=1)


def _kernel(q_ref, k_ref, v_ref, mask_ref, kv_len_ref, o_ref, m_ref, l_ref, *,
            cfg: AttentionConfig, scale: float):
    b, h, r, sp = (pl.program_id(i) for i in range(4))
    bs = cfg.block_s
    rows = pl.ds(pl.multiple_of(r * ROWS, ROWS), ROWS)
    q = q_ref[b, h, rows, :]
    lo = sp * cfg.split_s
    hi = jnp.minimum(lo + cfg.split_s, kv_len_ref[b])  # slots past kv_len are never visible
    nblocks = jnp.maximum(hi - lo + bs - 1, 0) // bs

    def body(i, carry):
        s0 = pl.multiple_of(lo + i * bs, bs)
        k = k_ref[b, pl.ds(s0, bs), h, :]
        v = v_ref[b, pl.ds(s0, bs), h, :]
        visible = mask_ref[b, rows, pl.ds(s0, bs)] != 0
        return online_softmax_block(q, k, v, visible, scale, carry)

    o, m, l = jax.lax.fori_loop(0, nblocks, body, online_softmax_init(q.shape[-1]))
    o_ref[b, h, sp, rows, :] = o
    m_ref[b, h, sp, rows] = m
    l_ref[b, h, sp, rows] = l


def _compiler_params(cfg: AttentionConfig, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array,
                     kv_len: jax.Array, config: AttentionConfig = AttentionConfig(),
                     interpret: bool = False) -> jax.Array:
    """q [B, T, Hq, hd], caches [B, S, Hkv, hd], mask [B, T, S] bool (slot visible to token),
    kv_len [B] int32 (no slot >= kv_len[b] is visible) -> [B, T, Hq * hd] in q's dtype."""
    B, T, Hq, hd = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    if Hq % Hkv or k_cache.shape != v_cache.shape or mask.shape != (B, T, S):
        raise ValueError(f"decode_attention: q {q.shape}, caches {k_cache.shape}/{v_cache.shape}, "
                         f"mask {mask.shape}")
    G = Hq // Hkv
    R = T * G
    Rp = -(-R // ROWS) * ROWS
    if S % config.block_s:  # the engine's caches come in multiples of 64 slots; this copies
        pad = config.block_s - S % config.block_s
        k_cache, v_cache = (jnp.pad(c, ((0, 0), (0, pad), (0, 0), (0, 0))) for c in (k_cache, v_cache))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
        S += pad
    splits = -(-S // config.split_s)
    qr = q.astype(k_cache.dtype).reshape(B, T, Hkv, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, R, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    mrows = jnp.broadcast_to(mask[:, :, None, :], (B, T, G, S)).reshape(B, R, S)
    mrows = jnp.pad(mrows, ((0, 0), (0, Rp - R), (0, 0))).astype(jnp.int8)  # padded rows: all masked
    f32 = jnp.float32
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, cfg=config, scale=hd ** -0.5),
        out_shape=(jax.ShapeDtypeStruct((B, Hkv, splits, Rp, hd), f32),
                   jax.ShapeDtypeStruct((B, Hkv, splits, Rp), f32),
                   jax.ShapeDtypeStruct((B, Hkv, splits, Rp), f32)),
        grid=(B, Hkv, Rp // ROWS, splits),
        compiler_params=_compiler_params(config, interpret),
        interpret=interpret,
        name="decode_attention",
    )(qr, k_cache, v_cache, mrows, kv_len.astype(jnp.int32))
    out = combine_splits(o, m, l)[:, :, :R]
    out = out.reshape(B, Hkv, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq * hd)
    return out.astype(q.dtype)


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Split partials [B, H, splits, R(, hd)] -> [B, H, R, hd], added in split order (a fixed
    order whatever the other shapes, so a row's result does not depend on T)."""
    top = jnp.max(m, axis=2)  # a max is exact in any order
    num = den = 0.0
    for j in range(o.shape[2]):
        w = jnp.exp(m[:, :, j] - top)
        num = num + w[..., None] * o[:, :, j]
        den = den + w * l[:, :, j]
    return num / den[..., None]


def decode_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               mask: jax.Array) -> jax.Array:
    """What `decode_attention` computes, in plain JAX (one softmax over all slots)."""
    B, T, Hq, hd = q.shape
    Hkv = k_cache.shape[2]
    qg = q.astype(k_cache.dtype).reshape(B, T, Hkv, Hq // Hkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * hd ** -0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache.astype(jnp.float32))
    return out.reshape(B, T, Hq * hd).astype(q.dtype)
