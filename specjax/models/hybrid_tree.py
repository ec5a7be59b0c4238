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

from specjax.models.gated_deltanet import GDNParams, gates, gdn_advance, gdn_output, gdn_project, split_qkv
from specjax.models.gdn_rule import normalize_qk
from specjax.models.gdn_tree import gdn_tree_parallel, path_windows
from specjax.models.hybrid_config import HybridConfig


def conv_over_windows(windows: jax.Array, weight: jax.Array, dtype) -> jax.Array:
    """windows [B, N, K, C] (oldest first), weight [K, C] -> silu(conv) [B, N, C]: `causal_conv`'s
    arithmetic (float32 sum in tap order, one rounding to the model dtype, then SiLU)."""
    wf = weight.astype(jnp.float32)
    acc = sum(wf[j] * windows[:, :, j].astype(jnp.float32) for j in range(weight.shape[0]))
    return jax.nn.silu(acc.astype(dtype))


def gdn_tree_layer(p: GDNParams, cfg: HybridConfig, h: jax.Array, state: jax.Array, window: jax.Array,
                   tree, kernels: str = "xla") -> jax.Array:
    """h [B, N, D] (normed) over the tree (parents [B, N], ancestors [B, N, N], depth) -> out [B, N, D]."""
    parents, ancestors, depth = tree
    conv_in, z, b, a = gdn_project(p, cfg, h)
    y = conv_over_windows(path_windows(window, conv_in, parents), p.conv_w, conv_in.dtype)
    q, k, v = split_qkv(cfg, y)
    g, beta = gates(p, b, a)
    q, k = normalize_qk(q, k)
    if kernels == "xla":
        core = gdn_tree_parallel(state, q, k, v, g, beta, ancestors, depth)
    else:
        from pallas_kernels.tree_gdn import tree_gdn
        core = tree_gdn(state, q, k, v, g, beta, ancestors, depth, interpret=kernels == "interpret")
    return gdn_output(p, cfg, core, z)


def gdn_replay(p: GDNParams, cfg: HybridConfig, h: jax.Array, state: jax.Array, window: jax.Array,
               count: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer over a path of R tokens (h [B, R, D], normed), each row's first count [B] real
    -> (out [B, R, D], state, window after them). One `gdn_advance` call per token, the call plain
    decoding makes (a multi-token scan compiles to other last bits on the CPU); past a row's count,
    g = beta = 0 and the window stays: an exact identity."""
    conv_in, z, b, a = gdn_project(p, cfg, h)
    xs = [jnp.moveaxis(x, 1, 0)[:, :, None] for x in (conv_in, b, a)]  # [R, B, 1, ...]
    live = jnp.arange(h.shape[1])[:, None] < count[None, :]  # [R, B]

    def token(carry, inputs):
        conv_in, b, a, valid = inputs
        core, s, w = gdn_advance(p, cfg, *carry, conv_in, b, a, valid.astype(jnp.int32))
        return (s, w), core[:, 0]

    (state, window), cores = jax.lax.scan(token, (state, window), (*xs, live))
    return gdn_output(p, cfg, jnp.moveaxis(cores, 0, 1), z), state, window
