"""The Gated DeltaNet token mixer of Qwen3-Next, as separately callable pure pieces.

    h --gdn_project--> conv_in, z, b, a
    conv_in --causal_conv--> y --split_qkv--> q, k, v;   b, a --gates--> g, beta
    q, k --gdn_rule.normalize_qk-->;  gdn_rule.gdn_scan(state, q, k, v, g, beta) --> core
    core, z --gdn_output--> out

Tree verification replaces only the conv and the recurrence, so those are kept apart.

Layout: the fused input projection `w_in` [D, in_proj_size] has its columns in the order
[q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv)], heads major, value head
j of key head i at index i * (Hv // Hk) + j. transformers' in_proj_qkvz / in_proj_ba interleave these
per key head; the loader permutes the columns once (a column permutation changes no output value), so
`conv_in` is one contiguous slice in the conv's channel order and no reshuffle runs per step.

Dtypes follow transformers: projections, conv and the gated norm's scale in the model dtype; the
decay g, the recurrence and the state in float32; beta = sigmoid(b) in the model dtype, then float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.gdn_rule import gdn_scan, normalize_qk
from specjax.models.gdn_tree import commit_window
from specjax.models.hybrid_config import HybridConfig
from specjax.models.linear import linear
from specjax.rounding import round_like


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNParams:
    w_in: jax.Array  # [D, in_proj_size]: columns q | k | v | z | b | a (see the module docstring)
    conv_w: jax.Array  # [K, conv_dim] depthwise causal conv taps, oldest input first
    A_log: jax.Array  # [Hv]
    dt_bias: jax.Array  # [Hv]
    norm: jax.Array  # [dv] gated RMSNorm scale (a plain weight, not 1 + weight)
    w_out: jax.Array  # [Hv * dv, D]


def gdn_project(p: GDNParams, cfg: HybridConfig, h: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] (normed) -> conv_in [B, T, conv_dim], z [B, T, Hv, dv], b [B, T, Hv], a [B, T, Hv]."""
    return split_projection(cfg, linear(h, p.w_in))


def split_projection(cfg: HybridConfig, proj: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """in_proj's output [B, T, in_proj_size] -> conv_in, z, b, a (as `gdn_project`)."""
    B, T, _ = proj.shape
    Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    conv_in, z, b, a = jnp.split(proj, [cfg.conv_dim, cfg.conv_dim + cfg.value_dim,
                                        cfg.conv_dim + cfg.value_dim + Hv], axis=-1)
    return conv_in, z.reshape(B, T, Hv, dv), b, a


def causal_conv(window: jax.Array, x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d + SiLU. window [B, K-1, C] (the last K-1 inputs before x, zeros at the
    start), x [B, T, C], weight [K, C] -> (y [B, T, C], new window [B, K-1, C]).

    y[t] = silu(sum_j weight[j] * ext[t + j]) with ext = window ++ x: torch's conv1d (cross-correlation)
    over the left-padded input. Accumulated in float32 and rounded once to x's dtype before the SiLU,
    as torch's conv does."""
    K, T = weight.shape[0], x.shape[1]
    ext = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    extf, wf = ext.astype(jnp.float32), weight.astype(jnp.float32)
    acc = sum(wf[j] * extf[:, j:j + T] for j in range(K))
    return jax.nn.silu(acc.astype(x.dtype)), ext[:, T:]


def split_qkv(cfg: HybridConfig, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Conv output [B, T, conv_dim] -> q, k [B, T, Hv, dk] (each key head repeated for its value heads,
    repeat-interleaved as transformers), v [B, T, Hv, dv]."""
    B, T, _ = y.shape
    Hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    q, k, v = jnp.split(y, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    rep = cfg.value_heads_per_key_head
    q = jnp.repeat(q.reshape(B, T, Hk, dk), rep, axis=2)
    k = jnp.repeat(k.reshape(B, T, Hk, dk), rep, axis=2)
    return q, k, v.reshape(B, T, cfg.linear_num_value_heads, cfg.linear_value_head_dim)


def gates(p: GDNParams, b: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """b, a [B, T, Hv] -> (g: log decay, <= 0; beta: write strength in (0, 1)), both float32.
    g in float32 throughout: exp(A_log) in bf16 could round a large A to inf (transformers' note)."""
    f32 = jnp.float32
    g = -jnp.exp(p.A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + p.dt_bias.astype(f32))
    return g, jax.nn.sigmoid(b).astype(f32)


def gdn_output(p: GDNParams, cfg: HybridConfig, core: jax.Array, z: jax.Array) -> jax.Array:
    """Gated RMSNorm over each head's dv (norm, scale, times SiLU(z)), then out_proj.
    core [B, T, Hv, dv] (float32 from the recurrence), z [B, T, Hv, dv] -> [B, T, D]."""
    return linear(gated_norm(p, cfg, core, z), p.w_out)


def gated_norm(p: GDNParams, cfg: HybridConfig, core: jax.Array, z: jax.Array) -> jax.Array:
    """`gdn_output` before out_proj -> [B, T, value_dim] in the model dtype."""
    B, T = core.shape[:2]
    dtype = z.dtype
    xf = round_like(core, dtype)  # transformers hands the norm the model dtype (specjax/rounding.py)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    scaled = p.norm * xf.astype(dtype)
    gated = scaled.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    return gated.astype(dtype).reshape(B, T, cfg.value_dim)


def gdn_advance(p: GDNParams, cfg: HybridConfig, state: jax.Array, window: jax.Array, conv_in: jax.Array,
                b: jax.Array, a: jax.Array, valid: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The recurrent half of the mixer: T projected tokens in order from (state, window)
    -> (core [B, T, Hv, dv] float32, new state, new window). Plain decoding and the commit after a
    verify step (the accepted path's tokens) both run exactly this. valid [B]: each row's real
    tokens; past them g = beta = 0 (the state stays exactly as it is) and the new window is the
    last K-1 real inputs."""
    y, new_window = causal_conv(window, conv_in, p.conv_w)
    q, k, v = split_qkv(cfg, y)
    g, beta = gates(p, b, a)
    if valid is not None:
        live = (jnp.arange(conv_in.shape[1])[None, :] < valid[:, None])[..., None]
        g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
        new_window = commit_window(window, conv_in, None, valid - 1)
    q, k = normalize_qk(q, k)
    core, state = gdn_scan(state, q, k, v, g, beta)
    return core, state, new_window


def gdn_layer(p: GDNParams, cfg: HybridConfig, h: jax.Array, state: jax.Array, window: jax.Array,
              valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mixer over T new tokens in order. h [B, T, D] (normed), state [B, Hv, dk, dv] float32,
    window [B, K-1, conv_dim] -> (out [B, T, D], new state, new window); valid as `gdn_advance`."""
    conv_in, z, b, a = gdn_project(p, cfg, h)
    core, state, window = gdn_advance(p, cfg, state, window, conv_in, b, a, valid)
    return gdn_output(p, cfg, core, z), state, window
