"""Gated DeltaNet over a token tree: every node's output in one parallel pass, no per-node state.

Node i's state would be its parent's state advanced by node i's token (`gdn_rule.gdn_step`). Unrolled
along i's root path, with path sums G_i = sum of g over path(i) (root .. i, the committed state S0
before the root), the written values u_i = beta_i (v_i - k_i^T S_parent(i) decayed) satisfy

    u_i + sum_{j strict ancestor of i} beta_i e^(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - e^G_i S0^T k_i)
    o_i = e^G_i S0^T q_i + sum_{j ancestor of i or i} e^(G_i - G_j) (q_i . k_j) u_j

a unit lower-triangular system (nodes are in topological order) solved once for all nodes: the
chunkwise (UT-transform) form of a chain with the causal mask replaced by the ancestor mask and
prefix sums by path sums (docs/design/hybrid.md). A chain is the special case ancestors = lower.

The committed state is not taken from this form: the accepted path is replayed with the decode step
itself at the head of the next forward (`hybrid_tree.gdn_replay`), so it is plain decoding's state
bit for bit, given the same projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.gdn_rule import gdn_step


def path_sums(g: jax.Array, ancestors: jax.Array) -> jax.Array:
    """g [B, N, H], ancestors [B, N, N] (i sees j; diagonal set) -> G [B, N, H] = sum over path(i)."""
    return jnp.einsum("bij,bjh->bih", ancestors.astype(jnp.float32), g.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def inverse_unit_lower(a: jax.Array, depth: int) -> jax.Array:
    """(I + A)^-1 for A [..., N, N] strictly lower with A^(depth+1) = 0 (no ancestor chain is longer
    than the tree's depth): (I - A)(I + A^2)(I + A^4)... with ceil(log2(depth + 1)) factors. Only
    matmuls, so a kernel can use tensor cores instead of N dependent substitution steps."""
    hp = jax.lax.Precision.HIGHEST
    eye = jnp.eye(a.shape[-1], dtype=a.dtype)
    inv, power, reach = eye - a, a, 2
    while reach <= depth:  # inv = sum_{n < reach} (-A)^n; power = A^(reach/2)
        power = jnp.matmul(power, power, precision=hp)
        inv = jnp.matmul(inv, eye + power, precision=hp)
        reach *= 2
    return inv


def gdn_tree_parallel(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                      beta: jax.Array, ancestors: jax.Array, depth: int) -> jax.Array:
    """All nodes' outputs. state [B, H, dk, dv] (committed), q/k [B, N, H, dk] (normalized as for
    `gdn_step`), v [B, N, H, dv], g/beta [B, N, H], ancestors [B, N, N] bool, depth: the tree's
    maximum depth (static) -> o [B, N, H, dv] float32."""
    hp = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    q, k, v, g, beta, state = (x.astype(f32) for x in (q, k, v, g, beta, state))
    G = path_sums(g, ancestors)  # [B, N, H]
    anc = ancestors[:, None]  # [B, 1, N, N]
    Gh = jnp.moveaxis(G, 2, 1)  # [B, H, N]
    diff = Gh[..., :, None] - Gh[..., None, :]  # G_i - G_j
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, diff, 0.0)), 0.0)  # [B, H, N, N]
    kk = jnp.einsum("bihd,bjhd->bhij", k, k, precision=hp)
    qk = jnp.einsum("bihd,bjhd->bhij", q, k, precision=hp)
    strict = anc & ~jnp.eye(q.shape[1], dtype=bool)
    bh = jnp.moveaxis(beta, 2, 1)  # [B, H, N]
    a = jnp.where(strict, bh[..., :, None] * decay * kk, 0.0)
    s0k = jnp.einsum("bhkv,bihk->bhiv", state, k, precision=hp)  # S0^T k_i
    s0q = jnp.einsum("bhkv,bihk->bhiv", state, q, precision=hp)
    vh = jnp.moveaxis(v, 2, 1)  # [B, H, N, dv]
    eg = jnp.exp(Gh)[..., None]
    r = bh[..., None] * (vh - eg * s0k)
    u = jnp.matmul(inverse_unit_lower(a, depth), r, precision=hp)
    o = eg * s0q + jnp.matmul(decay * qk, u, precision=hp)
    return jnp.moveaxis(o, 1, 2)


def gdn_tree_reference(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                       beta: jax.Array, parents) -> jax.Array:
    """The plain recurrence node by node from the parent's state (parents: a static sequence,
    parents[0] = -1: the root continues the committed state) -> o [B, N, H, dv]."""
    states, outs = [], []
    for i, p in enumerate(parents):
        s, o = gdn_step(state if p < 0 else states[p], q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        states.append(s)
        outs.append(o)
    return jnp.stack(outs, axis=1)


def path_windows(window: jax.Array, x: jax.Array, parents: jax.Array) -> jax.Array:
    """The short convolution's inputs along each node's path: window [B, K-1, C] (the committed
    last K-1 inputs, oldest first), x [B, N, C] (the nodes' inputs), parents [B, N] (-1: root)
    -> [B, N, K, C], oldest first, ending with the node's own input. Before the root the path
    continues into the committed window."""
    k1 = window.shape[1]
    buf = jnp.concatenate([window, x], axis=1)  # window slot s at s, node j at k1 + j
    idx = k1 + jnp.broadcast_to(jnp.arange(x.shape[1]), parents.shape)
    taps = [idx]
    for _ in range(k1):  # one step back along the path: a node's parent, or the previous slot
        node = idx - k1
        parent = jnp.take_along_axis(parents, jnp.clip(node, 0, None), axis=1)
        idx = jnp.where(node >= 0, jnp.where(parent >= 0, k1 + parent, k1 - 1), idx - 1)
        taps.append(idx)
    order = jnp.stack(taps[::-1], axis=2)  # [B, N, K]
    return jnp.take_along_axis(buf[:, None], order[..., None], axis=2)


def commit_window(window: jax.Array, x: jax.Array, path: jax.Array, num_accepted: jax.Array) -> jax.Array:
    """The committed window after the accepted path: the last K-1 of (window, x[path[0..n]])
    (path None: the nodes in order, x[0..n])."""
    k1 = window.shape[1]
    on_path = x if path is None else jnp.take_along_axis(x, path[..., None], axis=1)
    seq = jnp.concatenate([window.astype(x.dtype), on_path], axis=1)
    idx = num_accepted[:, None] + 1 + jnp.arange(k1)[None, :]
    return jnp.take_along_axis(seq, idx[..., None], axis=1)
