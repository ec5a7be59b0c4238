"""The gated delta rule (Gated DeltaNet's recurrence), token by token: the decode kernel's math and
the reference every parallel form (prefill, tree verification) is checked against.

Per head, with state S [dk, dv] (float32):  S <- exp(g) * S;  S <- S + k (beta * (v - k^T S));
o = q^T S.  q and k arrive L2-normalized with q scaled by dk^-0.5 (`normalize_qk`), heads already
expanded to the value heads. Same arithmetic as transformers' `torch_recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def normalize_qk(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 L2 norm of q and k over head_dim, then q / sqrt(dk) (as the reference kernels)."""
    q, k = l2norm(q.astype(jnp.float32)), l2norm(k.astype(jnp.float32))
    return q / (q.shape[-1] ** 0.5), k


def gdn_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
             beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token. state [B, H, dk, dv] f32, q/k [B, H, dk], v [B, H, dv], g/beta [B, H]
    -> (new state, o [B, H, dv] f32)."""
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    state = state * jnp.exp(g)[..., None, None]
    kv_mem = jnp.sum(state * k[..., :, None], axis=-2)  # [B, H, dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, jnp.sum(state * q[..., :, None], axis=-2)


def gdn_scan(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
             beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """T tokens in order: q/k [B, T, H, dk], v [B, T, H, dv], g/beta [B, T, H]
    -> (outputs [B, T, H, dv] f32, final state)."""
    def step(s, xs):
        s, o = gdn_step(s, *xs)
        return s, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1), state
