"""The GDN layer of a verify step (a tree of N nodes; a chain is a tree), and the replay that
advances a GDN state over an accepted path.

Verify: each node's conv window is gathered along its path, and every node's output comes from the
layer's state by the tree-parallel form (`gdn_tree.gdn_tree_parallel` on XLA, the Pallas kernel
`tree_gdn` otherwise); the state and window are not advanced over the nodes. Replay: the accepted
path, deferred to the next forward (`HybridCache.replay`), runs through `gdn_advance`, the decode
step's own function, one token per call (docs/design/hybrid.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.gated_deltanet import (GDNParams, gated_norm, gates, gdn_advance, gdn_layer, gdn_project,
                                          split_projection, split_qkv)
from specjax.models.gdn_rule import normalize_qk
from specjax.models.gdn_tree import gdn_tree_parallel, path_windows
from specjax.models.hybrid_config import HybridConfig
from specjax.models.linear import linear
from specjax.models.row_packing import RowPacking


def conv_over_windows(windows: jax.Array, weight: jax.Array, dtype) -> jax.Array:
    """windows [B, N, K, C] (oldest first), weight [K, C] -> silu(conv) [B, N, C]: `causal_conv`'s
    arithmetic (float32 sum in tap order, one rounding to the model dtype, then SiLU)."""
    wf = weight.astype(jnp.float32)
    acc = sum(wf[j] * windows[:, :, j].astype(jnp.float32) for j in range(weight.shape[0]))
    return jax.nn.silu(acc.astype(dtype))


def gdn_tree_gated(p: GDNParams, cfg: HybridConfig, conv_in, z, b, a, state, window, tree, kernels: str = "xla",
                   mesh=None, prefix=None):
    """The GDN layer over N tree nodes (parents [B, N], ancestors [B, N, N], depth) from their
    projection (`gdn_project`'s four parts) to before out_proj -> [B, N, value_dim] (the caller
    runs out_proj: the packed serving forward runs both GEMMs on its flat bucket).
    prefix [B, P, conv_dim + 2 Hv]: the inputs (conv_in | b | a) of the tree's first P nodes,
    verified earlier; the N nodes given are then its later ones and `tree` the whole tree."""
    parents, ancestors, depth = tree
    N = z.shape[1]
    if prefix is not None:
        c, h = cfg.conv_dim, cfg.linear_num_value_heads
        conv_in, b, a = (jnp.concatenate([x, y], axis=1) for x, y in
                         zip((prefix[..., :c], prefix[..., c:c + h], prefix[..., c + h:]), (conv_in, b, a)))
    y = conv_over_windows(path_windows(window, conv_in, parents), p.conv_w, conv_in.dtype)
    q, k, v = split_qkv(cfg, y)
    g, beta = gates(p, b, a)
    q, k = normalize_qk(q, k)
    if kernels == "xla":
        core = gdn_tree_parallel(state, q, k, v, g, beta, ancestors, depth)
    else:
        from specjax.sharding.tp_hybrid import tree_gdn_kernel  # split by value heads under a mesh
        core = tree_gdn_kernel(state, q, k, v, g, beta, ancestors, depth, kernels == "interpret", mesh)
    return gated_norm(p, cfg, core[:, -N:], z)


def gdn_replay(p: GDNParams, cfg: HybridConfig, h: jax.Array, state: jax.Array, window: jax.Array,
               count: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer over a path of R tokens (h [B, R, D], normed), each row's first count [B] real
    -> (out [B, R, D], state, window after them). One `gdn_advance` call per token, the call plain
    decoding makes (a multi-token scan compiles to other last bits on the CPU); past a row's count,
    g = beta = 0 and the window stays: an exact identity."""
    conv_in, z, b, a = gdn_project(p, cfg, h)
    gated, state, window = gdn_replay_gated(p, cfg, conv_in, z, b, a, state, window, count)
    return linear(gated, p.w_out), state, window


def gdn_replay_gated(p: GDNParams, cfg: HybridConfig, conv_in, z, b, a, state, window, count):
    """`gdn_replay` from the projection to before out_proj -> (gated [B, R, value_dim], state, window)."""
    xs = [jnp.moveaxis(x, 1, 0)[:, :, None] for x in (conv_in, b, a)]  # [R, B, 1, ...]
    live = jnp.arange(conv_in.shape[1])[:, None] < count[None, :]  # [R, B]

    def token(carry, inputs):
        conv_in, b, a, valid = inputs
        core, s, w = gdn_advance(p, cfg, *carry, conv_in, b, a, valid.astype(jnp.int32))
        return (s, w), core[:, 0]

    (state, window), cores = jax.lax.scan(token, (state, window), (*xs, live))
    return gated_norm(p, cfg, jnp.moveaxis(cores, 0, 1), z), state, window


def gdn_mixer(p: GDNParams, cfg: HybridConfig, h, state, window, R: int, replay_len, tree, valid, kernels: str,
              mesh=None, prefix=None):
    """The GDN layer of `hybrid_run` over h [B, R + T, D]: the deferred path's R rows replayed
    into the state, then the T tokens (a chain advancing the state, or a tree from it; prefix as
    `gdn_tree_gated`) -> (out, state, window, the T tokens' inputs (conv_in | b | a) or None)."""
    outs, inputs = [], None
    if R:
        out_r, state, window = gdn_replay(p, cfg, h[:, :R], state, window, replay_len)
        outs.append(out_r)
    if tree is not None:
        conv_in, z, b, a = gdn_project(p, cfg, h[:, R:])
        outs.append(linear(gdn_tree_gated(p, cfg, conv_in, z, b, a, state, window, tree, kernels, mesh, prefix),
                           p.w_out))
        inputs = jnp.concatenate([conv_in, b, a], axis=-1)
    else:
        out_t, state, window = gdn_layer(p, cfg, h[:, R:], state, window, valid)
        outs.append(out_t)
    return (jnp.concatenate(outs, axis=1) if R else outs[0]), state, window, inputs


def gdn_mixer_packed(p: GDNParams, cfg: HybridConfig, h, state, window, R: int, replay_len, tree, kernels: str,
                     packing: RowPacking, mesh=None, prefix=None):
    """`gdn_mixer` of a tree (or chain) verify over the packed tokens h [1, N, D]: in_proj and
    out_proj on the bucket, the conv and recurrence over the rows."""
    conv_in, z, b, a = split_projection(cfg, packing.to_rows(linear(h, p.w_in)))  # [B, R + T, ...]
    gated = []
    if R:
        g_r, state, window = gdn_replay_gated(p, cfg, conv_in[:, :R], z[:, :R], b[:, :R], a[:, :R], state, window,
                                              replay_len)
        gated.append(g_r)
    conv_in, z, b, a = (x[:, R:] for x in (conv_in, z, b, a))
    gated.append(gdn_tree_gated(p, cfg, conv_in, z, b, a, state, window, tree, kernels, mesh, prefix))
    out = linear(packing.to_flat(jnp.concatenate(gated, axis=1)), p.w_out)
    return out, state, window, jnp.concatenate([conv_in, b, a], axis=-1)
