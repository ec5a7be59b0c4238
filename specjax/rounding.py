"""Rounding the compiler may not change: what lets two programs of different shapes (a T-token verify
step and T AR steps, an admission prefill and a prompt pass) produce the same bits.

XLA's GPU pipeline may drop a float32 -> bfloat16 -> float32 convert pair, keeping the float32
value ("excess precision", `xla_allow_excess_precision`, on by default), and whether it does
depends on how each program fuses: on an H100 (2026-12-08) a 5-token verify step of a random
SmolLM2-shaped model parted from 5 AR steps at layer 0 because RoPE's cos, rounded to bf16 by such
a pair, stayed float32 in one program; with the option off the two were bit for bit equal.
Implicit pairs come from every 16-bit elementwise op XLA computes in float32, so the engine's
programs are compiled with excess precision off (`exact_jit`), and the roundings the model code
states on purpose are `round_like`, an op no pass removes, so they hold in a caller's jit too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Every 16-bit op of an XLA fusion rounds as written (the CPU backend does so either way).
EXACT_ROUNDING = {"xla_allow_excess_precision": False}


def exact_jit(fun=None, **jit_kwargs):
    """`jax.jit` with EXACT_ROUNDING added to its compiler options; also a decorator factory:
    `@exact_jit` or `@functools.partial(exact_jit, static_argnames=...)`."""
    if fun is None:
        return functools.partial(exact_jit, **jit_kwargs)
    options = {**EXACT_ROUNDING, **jit_kwargs.pop("compiler_options", {})}
    return jax.jit(fun, compiler_options=options, **jit_kwargs)


def round_like(v: jax.Array, dtype) -> jax.Array:
    """float32 v rounded to the values of a 16-bit float dtype (as a cast rounds: to nearest even,
    subnormals kept, overflow to inf), kept in float32, as ops no compiler pass may drop."""
    info = jnp.finfo(dtype)
    out = jax.lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.minexp > jnp.finfo(jnp.float32).minexp:
        # reduce_precision flushes the dtype's subnormals (float16's below 2^-14) to zero; a cast
        # keeps them: scale by powers of two (exact) and round half to even at the subnormal step.
        step = 2.0 ** (info.minexp - info.nmant)
        out = jnp.where(jnp.abs(v) < 2.0 ** info.minexp, jnp.round(v / step) * step, out)
    return out
