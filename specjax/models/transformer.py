"""The dense decoder forward: pure functions over `ModelParams` and a `KVCache`.

One function, `forward`, serves prefill, AR decode, drafting and verification: it takes T new tokens per
row, writes their K/V at slots `start[b] .. start[b] + T - 1`, and attends over all S slots under a mask.
The default mask is causal over slots (slot j visible to the token written at slot i iff j <= i); tree
verification passes its own [B, T, S] mask and RoPE positions that differ from slot indices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.rms_norm import rms_norm as rms_norm_kernel
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, write_rows
from specjax.models.linear import is_kernel_weight, linear
from specjax.models.params import LayerParams, ModelParams
from specjax.models.rope import apply_rope, rope_cos_sin
from specjax.sharding.tp_attention import bind, head_parallel, splits_heads


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, impl: str = "xla") -> jax.Array:
    """As transformers: normalize in float32, cast back, then scale. impl "pallas" / "interpret":
    the kernel whose rows do not depend on the row count (pallas_kernels/rms_norm.py), which
    the kernel path needs for AR and verify steps to agree bit for bit."""
    if impl != "xla":
        return rms_norm_kernel(x, weight, eps, interpret=impl == "interpret")
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeMask:
    """A token tree's visibility in the verify forward (node i at slot start + i): the [B, N, S]
    mask for XLA's attention, and the ancestors [B, N, N] and depths [B, N] from which the fused
    kernel gathers each node's path into AR's slot layout (pallas_kernels/tree_attention.py), so
    a node's attention rounds exactly as the AR step of its token would."""

    dense: jax.Array
    ancestors: jax.Array
    depths: jax.Array
    max_depth: int = dataclasses.field(metadata=dict(static=True))


def dense_mask(mask):
    """A [B, T, S] mask from a mask or a `TreeMask`."""
    return mask.dense if isinstance(mask, TreeMask) else mask


def causal_slot_mask(start: jax.Array, num_new: int, num_slots: int) -> jax.Array:
    """[B, T, S] bool: new token t of row b (at slot start[b] + t) sees slots <= its own."""
    query_slot = start[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
    return jnp.arange(num_slots)[None, None, :] <= query_slot[:, :, None]


def dense_attention(cfg: ModelConfig, q, k_cache, v_cache, mask):
    """q [B, T, Hq, hd], caches [B, S, Hkv, hd], mask [B, T, S] -> [B, T, Hq * hd]."""
    B, T = q.shape[:2]
    groups = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(B, T, cfg.num_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=jnp.float32)
    scores = scores * (cfg.head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache, preferred_element_type=jnp.float32)
    return out.reshape(B, T, cfg.q_size).astype(q.dtype)


def _layer(cfg: ModelConfig, p: LayerParams, x, cos, sin, k_cache, v_cache, start, mask, mix=None,
           attention: str = "xla", norm: str = "xla", mesh=None):
    """One decoder layer over a dense cache. `mix(h, sublayer)` (block drafters) transforms the
    normed input of the attention (sublayer 0) and MLP (1) sublayers, e.g. DFlash2's in-block
    convolution. `attention`: "xla", "pallas" or "interpret" (the fused kernel,
    pallas_kernels/decode_attention.py, or tree_attention.py under a `TreeMask`)."""
    T = x.shape[1]

    def attend(q, k, v):
        kc = write_rows(k_cache, k, start)
        vc = write_rows(v_cache, v, start)
        if attention == "xla":
            return dense_attention(cfg, q, kc, vc, dense_mask(mask)), (kc, vc)
        interpret = attention == "interpret"
        if isinstance(mask, TreeMask):
            kernel = bind(tree_attention, max_depth=mask.max_depth, interpret=interpret)
            args = (start, mask.ancestors, mask.depths)
        else:  # no slot at or past start + T is visible (causal and tree masks alike)
            kernel, args = bind(decode_attention, interpret=interpret), (mask, start + T)
        if splits_heads(mesh, cfg.num_kv_heads):
            return head_parallel(kernel, mesh, q, kc, vc, *args), (kc, vc)
        return kernel(q, kc, vc, *args), (kc, vc)

    x, (k_cache, v_cache) = layer_with(cfg, p, x, cos, sin, attend, mix, norm)
    return x, k_cache, v_cache


def layer_with(cfg: ModelConfig, p: LayerParams, x, cos, sin, attend, mix=None, norm: str = "xla"):
    """One decoder layer with the K/V storage left to `attend(q, k, v) -> (mixed [B, T, q_size],
    new storage)`, so the dense cache and the serving engine's paged cache share every other op
    (and so their numerics). `norm`: the RMSNorm implementation (see `rms_norm`).
    Returns (x, new storage)."""
    B, T, _ = x.shape
    h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps, norm)
    if mix is not None:
        h = mix(h, 0)
    qkv = linear(h, p.w_qkv)
    if p.b_qkv is not None:
        qkv = qkv + p.b_qkv
    q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps, norm)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps, norm)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    mixed, storage = attend(q, k, v)
    attn = linear(mixed, p.w_o)
    if p.b_o is not None:
        attn = attn + p.b_o
    x = x + attn
    h = rms_norm(x, p.mlp_norm, cfg.rms_norm_eps, norm)
    if mix is not None:
        h = mix(h, 1)
    gate, up = jnp.split(linear(h, p.w_gate_up), 2, axis=-1)
    x = x + linear(jax.nn.silu(gate) * up, p.w_down)
    return x, storage


def forward(params: ModelParams, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, start: jax.Array, mask: jax.Array | None = None
            ) -> tuple[jax.Array, KVCache]:
    """tokens/positions [B, T] int32, start [B] int32 -> (final-normed hidden [B, T, D], new cache).

    Logits are left to `lm_logits` so callers compute them only at the positions they need
    (prefill needs one row, not T).
    """
    hidden, _, cache = forward_with_taps(params, cfg, tokens, positions, cache, start, (), mask)
    return hidden, cache


def forward_with_taps(params: ModelParams, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                      cache: KVCache, start: jax.Array, taps: tuple[int, ...] = (),
                      mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """`forward`, also returning the residual stream after each layer in `taps` (0-based), joined
    along features: [B, T, len(taps) * D] (None without taps). Block drafters condition on them."""
    T = tokens.shape[1]
    if mask is None:
        mask = causal_slot_mask(start, T, cache.num_slots)
    x = params.embed[tokens]
    cos, sin = rope_cos_sin(cfg, positions)
    new_k, new_v, tapped = [], [], {}
    for i, (p, kc, vc) in enumerate(zip(params.layers, cache.k, cache.v)):
        x, kc, vc = _layer(cfg, p, x, cos, sin, kc, vc, start, mask, attention=params.attention,
                           norm=params.norm, mesh=params.mesh)
        new_k.append(kc)
        new_v.append(vc)
        if i in taps:
            tapped[i] = x
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps, params.norm)
    return x, features, KVCache(k=new_k, v=new_v)


def lm_logits(params: ModelParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V]."""
    if params.lm_head is not None and is_kernel_weight(params.lm_head):
        return linear(hidden.astype(jnp.bfloat16), params.lm_head).astype(jnp.float32)
    head = params.embed.T if params.lm_head is None else params.lm_head
    return jnp.matmul(hidden, head, preferred_element_type=jnp.float32)
