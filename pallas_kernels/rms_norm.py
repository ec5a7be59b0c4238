"""RMSNorm over rows whose result does not depend on how many rows a call has.

Why a kernel for a norm: XLA picks a reduction strategy per shape, so the sum of squares of one
row can round differently when the call holds 1 row (an AR step) or k + 1 rows (a verify step).
Measured on XLA's CPU backend (2026-12-06): the mean over 576 bf16 values of a row differed
between shapes [2, 1, 576] and [2, 5, 576] in 145 of 200 random trials, and in a bf16 SmolLM2
that one-ulp difference flipped a greedy token (margin 0.125) after 35 tokens: the only op of the
kernel path that was not width-invariant (docs/notes/perf.md, 2026-12-06).

Here every program normalizes a fixed block of `block_rows` rows padded to a power-of-two width;
the reduction is one `jnp.sum` over that block's columns, so its order is fixed by the block
shape and the config (chosen from the width), never by the number of rows: an AR step and a
verify step agree bit for bit. Lanes past the width add zeros to the sum; lanes past the last row
or column repeat the last one (`_block_index`), so x is read and the output written in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Tuning config of `rms_norm`. Both fields shape the Triton layout of a block, and with it the
    order in which a row's squares are summed: numerics, so they are chosen from the width alone
    (`default_norm_config`), never from the row count."""

    block_rows: int = 16
    num_warps: int = 4

    def __post_init__(self):
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows must be a power of two, got {self.block_rows}")


def default_norm_config(width: int) -> NormConfig:
    """About 8k elements a program (16 rows of 512, 2 of 4096, 1 of 8192 or more): a block small
    enough to stay in registers, with 8 warps past 2048 columns."""
    padded = 1 << (width - 1).bit_length()
    return NormConfig(block_rows=max(1, min(16, 8192 // padded)), num_warps=4 if padded <= 2048 else 8)


def _block_index(i, m: int, d: int, rows: int, dp: int):
    """Row and column indexers of program i's [rows, Dp] block. Where the block runs past the
    array (m % rows rows, or Dp > d columns) the indices are clamped: missing rows repeat row
    m - 1 and missing columns column d - 1, so every lane computes a real element's value and the
    stores of the clamped lanes write those same bits again. No padded copy of x, no slice after:
    an AR step's norm (1 row) is one kernel, not a pad, a kernel and a slice."""
    if m % rows == 0 and dp == d:
        return pl.ds(pl.multiple_of(i * rows, rows), rows), slice(None), None
    r = jnp.minimum(i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, dp), 0), m - 1)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, dp), 1)
    if dp == d:  # only rows clamped: columns stay a plain iota, so each row's load stays contiguous
        return r, col, None
    return r, jnp.minimum(col, d - 1), col < d


def _kernel(x_ref, w_ref, o_ref, *, eps: float, m: int, width: int, rows: int, dp: int, plus_one: bool):
    r, c, real = _block_index(pl.program_id(0), m, width, rows, dp)
    xf = x_ref[r, c].astype(jnp.float32)  # [rows, Dp]
    sq = xf * xf if real is None else jnp.where(real, xf * xf, 0.0)  # zeros past the width, as padding
    mean_sq = jnp.sum(sq, axis=1, keepdims=True) / width  # the real width, not the padded one
    normed = xf * jax.lax.rsqrt(mean_sq + eps)
    w = w_ref[c if real is not None else slice(None)]
    if plus_one:  # Qwen3-Next style: scale by (1 + w) in float32, one rounding at the end
        o_ref[r, c] = (normed * (1.0 + w.astype(jnp.float32))).astype(o_ref.dtype)
    else:  # Llama style (as transformers): cast back, then scale in the input's dtype
        o_ref[r, c] = w.astype(o_ref.dtype) * normed.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "plus_one", "config", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False,
             config: NormConfig | None = None, interpret: bool = False) -> jax.Array:
    """x [..., D], weight [D] -> [..., D] in x's dtype; equals `rms_norm_reference` up to the
    order of the sum of squares. config: `default_norm_config(D)` when None."""
    lead, D = x.shape[:-1], x.shape[-1]
    config = config or default_norm_config(D)
    rows = x.reshape(-1, D)
    M = rows.shape[0]
    Dp = 1 << (D - 1).bit_length()  # Triton blocks are powers of two
    R = config.block_rows
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu  # GPU only
        params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, m=M, width=D, rows=R, dp=Dp, plus_one=plus_one),
        out_shape=jax.ShapeDtypeStruct((M, D), x.dtype),
        grid=(-(-M // R),),
        compiler_params=params,
        interpret=interpret,
        name="rms_norm",
    )(rows, weight.astype(x.dtype))
    return out.reshape(*lead, D)


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """What `rms_norm` computes, in plain JAX (XLA chooses the reduction order)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * normed.astype(x.dtype)
