"""The hybrid recurrent target (Qwen3-Next style): pure functions over `HybridParams` and a `HybridCache`.

Each layer is a token mixer, Gated DeltaNet (`gated_deltanet.py`) or gated attention, then a dense
SwiGLU MLP, both pre-normed and residual. `hybrid_forward` has `transformer.forward`'s contract: T new
tokens per row, attention K/V written at slots start .. start + T - 1 and read over all S slots under a
[B, T, S] mask (causal over slots by default); each GDN layer advances its recurrent state and conv
window over the T tokens in order.

Every RMSNorm except the GDN's gated one scales by (1 + weight), the weight stored as in the
checkpoint (its offset from 1), the sum formed in float32 (transformers' Qwen3NextRMSNorm).
Layers stay an unrolled Python list, as in the dense model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import decode_attention
from specjax.models.gated_deltanet import GDNParams, gdn_layer
from specjax.models.hybrid_tree import gdn_tree_layer
from specjax.models.hybrid_config import HybridConfig
from specjax.models.kv_cache import write_rows
from specjax.models.linear import linear
from specjax.models.rope import apply_rope
from specjax.models.transformer import dense_attention, causal_slot_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNLayerParams:
    in_norm: jax.Array  # [D] (1 + w)
    gdn: GDNParams
    mlp_norm: jax.Array  # [D] (1 + w)
    w_gate_up: jax.Array  # [D, 2 * F]
    w_down: jax.Array  # [F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnLayerParams:
    in_norm: jax.Array  # [D] (1 + w)
    w_qgkv: jax.Array  # [D, 2 * q_size + 2 * kv_size]: columns query | output gate | key | value
    q_norm: jax.Array  # [head_dim] (1 + w)
    k_norm: jax.Array  # [head_dim] (1 + w)
    w_o: jax.Array  # [q_size, D]
    mlp_norm: jax.Array  # [D] (1 + w)
    w_gate_up: jax.Array  # [D, 2 * F]
    w_down: jax.Array  # [F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridParams:
    embed: jax.Array  # [V, D]
    layers: list[GDNLayerParams | AttnLayerParams]  # in layer order, kinds as cfg.layer_types
    final_norm: jax.Array  # [D] (1 + w)
    lm_head: jax.Array | None = None  # [D, V]; None when tied to `embed`
    # "xla", or the Pallas kernels for attention and tree verification of the GDN layers
    # ("pallas"; "interpret": Pallas interpret mode on a CPU)
    kernels: str = dataclasses.field(default="xla", metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    k: list[jax.Array]  # per attention layer [B, S, Hkv, hd], slots as in kv_cache.py
    v: list[jax.Array]
    state: list[jax.Array]  # per GDN layer [B, Hv, dk, dv] float32
    conv: list[jax.Array]  # per GDN layer [B, K-1, conv_dim]: the last K-1 conv inputs

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[1] if self.k else 0


def init_hybrid_cache(cfg: HybridConfig, batch: int, num_slots: int) -> HybridCache:
    dtype = jnp.dtype(cfg.dtype)
    kv = (batch, num_slots, cfg.num_kv_heads, cfg.head_dim)
    state = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv = (batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
    return HybridCache(k=[jnp.zeros(kv, dtype) for _ in range(n_attn)],
                       v=[jnp.zeros(kv, dtype) for _ in range(n_attn)],
                       state=[jnp.zeros(state, jnp.float32) for _ in range(n_gdn)],
                       conv=[jnp.zeros(conv, dtype) for _ in range(n_gdn)])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3-Next's RMSNorm: normalize and scale by (1 + weight) in float32, then cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def rope_cos_sin(cfg: HybridConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, rotary_dim] float32 for the partial RoPE (frequencies over
    rotary_dim, not head_dim; computed as `rope.py` does)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv.astype(np.float32))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first rotary_dim dims of x [B, T, H, hd] (rotate-half within them); pass the rest."""
    rd = cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)


def _gated_attention(cfg: HybridConfig, p: AttnLayerParams, h, cos, sin, k_cache, v_cache, start, mask,
                     kernels: str = "xla"):
    """h [B, T, D] (normed) -> (out [B, T, D], new caches). Output scaled by sigmoid(gate) per channel."""
    B, T, _ = h.shape
    q, gate, k, v = jnp.split(linear(h, p.w_qgkv),
                              [cfg.q_size, 2 * cfg.q_size, 2 * cfg.q_size + cfg.kv_size], axis=-1)
    q = rms_norm(q.reshape(B, T, cfg.num_heads, cfg.head_dim), p.q_norm, cfg.rms_norm_eps)
    k = rms_norm(k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim), p.k_norm, cfg.rms_norm_eps)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    q = apply_partial_rope(q, cos, sin)
    k = apply_partial_rope(k, cos, sin)
    k_cache = write_rows(k_cache, k, start)
    v_cache = write_rows(v_cache, v, start)
    if kernels == "xla":
        mixed = dense_attention(cfg, q, k_cache, v_cache, mask)  # reads num_heads, num_kv_heads, head_dim, q_size
    else:  # the fused kernel (any mask: causal or a tree's); no slot at or past start + T is visible
        mixed = decode_attention(q, k_cache, v_cache, mask, start + q.shape[1], interpret=kernels == "interpret")
    return linear(mixed * jax.nn.sigmoid(gate), p.w_o), k_cache, v_cache


def _mlp(p: GDNLayerParams | AttnLayerParams, h: jax.Array) -> jax.Array:
    gate, up = jnp.split(linear(h, p.w_gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, p.w_down)


def hybrid_forward(params: HybridParams, cfg: HybridConfig, tokens: jax.Array, positions: jax.Array,
                   cache: HybridCache, start: jax.Array, mask: jax.Array | None = None
                   ) -> tuple[jax.Array, HybridCache]:
    """tokens/positions [B, T] int32, start [B] int32 -> (final-normed hidden [B, T, D], new cache).
    `mask` [B, T, S] applies to the attention layers only; GDN layers run the T tokens as a chain."""
    hidden, _, cache, _ = hybrid_run(params, cfg, tokens, positions, cache, start, mask)
    return hidden, cache


def hybrid_run(params: HybridParams, cfg: HybridConfig, tokens: jax.Array, positions: jax.Array,
               cache: HybridCache, start: jax.Array, mask: jax.Array | None = None,
               valid: jax.Array | None = None, taps: tuple[int, ...] = (), tree=None):
    """`hybrid_forward` with the engine's options -> (hidden, features, cache, pending).

    valid [B]: each row's real tokens (the rest, right-padding, never reaches a GDN state).
    taps: layers whose output residual stream is returned, joined along features (block drafters).
    tree: (parents [B, T], ancestors [B, T, T], depth) to verify T tree nodes: GDN layers compute
    every node's output from the committed state (`hybrid_tree.py`) and leave the state and window
    as they are; `pending` then holds each GDN layer's per-node inputs for `commit_states`."""
    T = tokens.shape[1]
    if mask is None:
        mask = causal_slot_mask(start, T, cache.num_slots)
    x = params.embed[tokens]
    cos, sin = rope_cos_sin(cfg, positions)
    new = HybridCache(k=list(cache.k), v=list(cache.v), state=list(cache.state), conv=list(cache.conv))
    attn_index = {layer: n for n, layer in enumerate(cfg.attn_layers)}
    gdn_index = {layer: n for n, layer in enumerate(cfg.gdn_layers)}
    pending, tapped = [], {}
    for i, p in enumerate(params.layers):
        h = rms_norm(x, p.in_norm, cfg.rms_norm_eps)
        if i in attn_index:
            n = attn_index[i]
            out, new.k[n], new.v[n] = _gated_attention(cfg, p, h, cos, sin, new.k[n], new.v[n], start, mask,
                                                       params.kernels)
        elif tree is not None:
            out, record = gdn_tree_layer(p.gdn, cfg, h, new.state[gdn_index[i]], new.conv[gdn_index[i]], tree,
                                         params.kernels)
            pending.append(record)
        else:
            n = gdn_index[i]
            out, new.state[n], new.conv[n] = gdn_layer(p.gdn, cfg, h, new.state[n], new.conv[n], valid)
        x = x + out
        x = x + _mlp(p, rms_norm(x, p.mlp_norm, cfg.rms_norm_eps))
        if i in taps:
            tapped[i] = x
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps), features, new, pending


def hybrid_logits(params: HybridParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V]."""
    head = params.embed.T if params.lm_head is None else params.lm_head
    return jnp.matmul(hidden, head, preferred_element_type=jnp.float32)


def init_random_hybrid_params(cfg: HybridConfig, key: jax.Array, scale: float = 0.02) -> HybridParams:
    """Random weights for tests and benchmarks: matrices normal * scale, (1 + w) norm offsets near 0,
    gated-norm scales near 1. Decay rates A are drawn from [0.05, 1] (transformers' init goes up to 16,
    which forgets nearly everything each token) so the recurrent state matters across tokens."""
    dtype = jnp.dtype(cfg.dtype)
    D, F, V, Hv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.linear_num_value_heads
    keys = iter(jax.random.split(key, 12 * cfg.num_layers + 3))

    def normal(shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def offset_norm(n):  # (1 + w) norms
        return normal((n,), 0.1)

    def mlp():
        return dict(mlp_norm=offset_norm(D), w_gate_up=normal((D, 2 * F)), w_down=normal((F, D)))

    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            layers.append(AttnLayerParams(
                in_norm=offset_norm(D), w_qgkv=normal((D, 2 * cfg.q_size + 2 * cfg.kv_size)),
                q_norm=offset_norm(cfg.head_dim), k_norm=offset_norm(cfg.head_dim),
                w_o=normal((cfg.q_size, D)), **mlp()))
        else:
            A = jax.random.uniform(next(keys), (Hv,), jnp.float32, 0.05, 1.0)
            gdn = GDNParams(
                w_in=normal((D, cfg.in_proj_size)),
                conv_w=normal((cfg.linear_conv_kernel_dim, cfg.conv_dim), 0.3),
                A_log=jnp.log(A).astype(dtype), dt_bias=normal((Hv,), 0.5),
                norm=(1.0 + normal((cfg.linear_value_head_dim,), 0.1)).astype(dtype),
                w_out=normal((cfg.value_dim, D)))
            layers.append(GDNLayerParams(in_norm=offset_norm(D), gdn=gdn, **mlp()))
    return HybridParams(embed=normal((V, D)), layers=layers, final_norm=offset_norm(D),
                        lm_head=None if cfg.tie_word_embeddings else normal((D, V)))
