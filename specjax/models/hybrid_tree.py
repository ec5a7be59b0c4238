"""The GDN layer of a verify step (a tree of N nodes; a chain is a tree) and the commit after it.

Verify: each node's conv window is gathered along its path, and every node's output comes from the
committed state by the tree-parallel form (`gdn_tree.gdn_tree_parallel` on XLA, the Pallas kernel
`tree_gdn` otherwise); the layer's state and window stay as they are, and its per-node inputs go
to a pending record (its projections). Commit: the accepted path's projections are replayed by
`gdn_advance`, the decode step's own function, from the committed state and window
(docs/design/hybrid.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.gated_deltanet import GDNParams, gates, gdn_advance, gdn_output, gdn_project, split_qkv
from specjax.models.gdn_rule import normalize_qk
from specjax.models.gdn_tree import gdn_tree_parallel, path_windows
from specjax.models.hybrid_config import HybridConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingGDN:
    """One GDN layer's per-node projections of a verify step, all the commit needs to replay the
    accepted path (model dtype: conv_dim + 2 Hv numbers a node, ~6% of a float32 q/k/v/g/beta record
    plus the conv inputs)."""
    conv_in: jax.Array  # [B, N, conv_dim]
    b: jax.Array  # [B, N, Hv]
    a: jax.Array


def conv_over_windows(windows: jax.Array, weight: jax.Array, dtype) -> jax.Array:
    """windows [B, N, K, C] (oldest first), weight [K, C] -> silu(conv) [B, N, C]: `causal_conv`'s
    arithmetic (float32 sum in tap order, one rounding to the model dtype, then SiLU)."""
    wf = weight.astype(jnp.float32)
    acc = sum(wf[j] * windows[:, :, j].astype(jnp.float32) for j in range(weight.shape[0]))
    return jax.nn.silu(acc.astype(dtype))


def gdn_tree_layer(p: GDNParams, cfg: HybridConfig, h: jax.Array, state: jax.Array, window: jax.Array,
                   tree, kernels: str = "xla") -> tuple[jax.Array, PendingGDN]:
    """h [B, N, D] (normed) over the tree (parents [B, N], ancestors [B, N, N], depth)
    -> (out [B, N, D], pending record)."""
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
    return gdn_output(p, cfg, core, z), PendingGDN(conv_in, b, a)


def commit_states(params, cfg: HybridConfig, cache, pending: list[PendingGDN], path: jax.Array,
                  num_accepted: jax.Array):
    """Each GDN layer's state and window after the accepted path[:, :num_accepted + 1]: the path's
    projections run through `gdn_advance`, the function plain decoding runs, from the committed
    state and window (so the state is plain decoding's, bit for bit, given the same projections)."""
    def on_path(x):
        return jnp.take_along_axis(x, path[..., None], axis=1)

    states, windows = [], []
    gdn_params = [params.layers[i].gdn for i in cfg.gdn_layers]
    live = jnp.arange(path.shape[1])[:, None] <= num_accepted[None, :]  # [D + 1, B]
    for p, s, w, r in zip(gdn_params, cache.state, cache.conv, pending):
        xs = [jnp.moveaxis(on_path(x), 1, 0)[:, :, None] for x in (r.conv_in, r.b, r.a)]  # [D + 1, B, 1, ...]

        def token(carry, inputs, p=p):  # one plain decode step per path position
            conv_in, b, a, valid = inputs
            _, s, w = gdn_advance(p, cfg, *carry, conv_in, b, a, valid.astype(jnp.int32))
            return (s, w), None

        (s, w), _ = jax.lax.scan(token, (s, w), (*xs, live))
        states.append(s)
        windows.append(w)
    return states, windows
