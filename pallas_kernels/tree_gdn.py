"""Gated DeltaNet over a token tree (hybrid targets' verify step): one Pallas kernel per layer.

Grid (B, value heads, dv blocks). A program reads the committed state's [dk, block_dv] columns
once, the N nodes' q, k (all dk), v columns, path sums G and betas, and the tree's ancestor mask,
and writes only the N outputs: no per-node state ever reaches HBM (a per-position snapshot design
writes N states of dk * dv floats per layer instead). The math is `specjax.models.gdn_tree`:

    A = strict-ancestor mask * beta_i e^(G_i - G_j) (K K^T)       [N, N]
    U = (I + A)^-1 (beta * (V - e^G * (K S0)))                    (I + A)^-1 by repeated squaring
    O = e^G * (Q S0) + (ancestor mask * e^(G_i - G_j) (Q K^T)) U

Everything is float32 with IEEE dots (`precision=HIGHEST`: TF32 would cost ~1e-3 relative, enough to
flip near-tie tokens). Columns of V, U, S0 and O are independent, so dv splits across programs and
each recomputes the small [N, N] matrices. N is padded to a power of two >= 16 (Triton's blocks):
a padding node has beta = 0 and sees only itself, so it writes u = 0 and changes nobody.

`tree_gdn_reference` is the plain recurrence node by node from the parent's state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specjax.models.gdn_tree import gdn_tree_reference, path_sums

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class TreeGDNConfig:
    """Tuning config of `tree_gdn` (speed only: a column's arithmetic does not depend on it)."""

    block_dv: int = 64
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        if self.block_dv < 16 or self.block_dv & (self.block_dv - 1):
            raise ValueError(f"block_dv must be a power of two >= 16, got {self.block_dv}")


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, anc_ref, s_ref, o_ref, *, levels: int):
    q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]  # [N, dk], [N, dk], [N, bdv]
    G, beta = g_ref[0, 0], beta_ref[0, 0]  # [N]
    anc = anc_ref[0] != 0  # [N, N]
    s0 = s_ref[0, 0]  # [dk, bdv]
    n = q.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    decay = jnp.where(anc, jnp.exp(jnp.where(anc, G[:, None] - G[None, :], 0.0)), 0.0)
    a = jnp.where(anc & (rows != cols), beta[:, None] * decay * _dot(k, k.T), 0.0)
    eg = jnp.exp(G)[:, None]
    r = beta[:, None] * (v - eg * _dot(k, s0))
    eye = jnp.where(rows == cols, 1.0, 0.0)
    inv, power = eye - a, a
    for _ in range(levels):  # (I - A)(I + A^2)(I + A^4)...: A is nilpotent within the tree's depth
        power = _dot(power, power)
        inv = _dot(inv, eye + power)
    u = _dot(inv, r)
    o_ref[0, 0] = eg * _dot(q, s0) + _dot(decay * _dot(q, k.T), u)


def _levels(depth: int) -> int:
    levels, reach = 0, 2
    while reach <= depth:
        levels, reach = levels + 1, reach * 2
    return levels


def _compiler_params(cfg: TreeGDNConfig, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.partial(jax.jit, static_argnames=("depth", "config", "interpret"))
def tree_gdn(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
             ancestors: jax.Array, depth: int, config: TreeGDNConfig = TreeGDNConfig(),
             interpret: bool = False) -> jax.Array:
    """state [B, H, dk, dv], q/k [B, N, H, dk] (normalized), v [B, N, H, dv], g/beta [B, N, H],
    ancestors [B, N, N] bool (diagonal set), depth: the tree's maximum depth (static)
    -> o [B, N, H, dv] float32."""
    B, N, H, dk = q.shape
    dv = v.shape[-1]
    bdv = min(config.block_dv, dv)
    if dv % bdv or state.shape != (B, H, dk, dv) or ancestors.shape != (B, N, N):
        raise ValueError(f"tree_gdn: state {state.shape}, q {q.shape}, v {v.shape}, ancestors "
                         f"{ancestors.shape}, block_dv {bdv}")
    Np = max(16, 1 << (N - 1).bit_length())  # Triton blocks: powers of two
    f32 = jnp.float32
    G = path_sums(g, ancestors)

    def heads_first(x):  # [B, N, H, ...] -> [B, H, Np, ...] float32
        x = jnp.moveaxis(x.astype(f32), 2, 1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, Np - N)) + ((0, 0),) * (x.ndim - 3))

    anc = jnp.pad(ancestors, ((0, 0), (0, Np - N), (0, Np - N)))
    anc = (anc | jnp.eye(Np, dtype=bool)[None]).astype(jnp.int8)
    o = pl.pallas_call(
        functools.partial(_kernel, levels=_levels(depth)),
        out_shape=jax.ShapeDtypeStruct((B, H, Np, dv), f32),
        grid=(B, H, dv // bdv),
        in_specs=[
            pl.BlockSpec((1, 1, Np, dk), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec((1, 1, Np, dk), lambda b, h, c: (b, h, 0, 0)),
            pl.BlockSpec((1, 1, Np, bdv), lambda b, h, c: (b, h, 0, c)),
            pl.BlockSpec((1, 1, Np), lambda b, h, c: (b, h, 0)),
            pl.BlockSpec((1, 1, Np), lambda b, h, c: (b, h, 0)),
            pl.BlockSpec((1, Np, Np), lambda b, h, c: (b, 0, 0)),
            pl.BlockSpec((1, 1, dk, bdv), lambda b, h, c: (b, h, 0, c)),
        ],
        out_specs=pl.BlockSpec((1, 1, Np, bdv), lambda b, h, c: (b, h, 0, c)),
        compiler_params=_compiler_params(config, interpret),
        interpret=interpret,
        name="tree_gdn",
    )(heads_first(q), heads_first(k), heads_first(v), heads_first(G), heads_first(beta), anc,
      state.astype(f32))
    return jnp.moveaxis(o[:, :, :N], 1, 2)


def tree_gdn_reference(state, q, k, v, g, beta, parents) -> jax.Array:
    """What `tree_gdn` computes, by the plain recurrence node by node (parents: static sequence)."""
    return gdn_tree_reference(state, q, k, v, g, beta, parents)
