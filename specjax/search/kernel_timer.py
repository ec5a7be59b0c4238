"""GPU timing of the skinny GEMMs (pallas_kernels/skinny_gemm*.py), for the kernel tuner and the
kernel calibration: `KernelTimer()(shape, fmt, config, T)` -> seconds per call.

One call of the timed program runs `reps` rounds over several copies of the weight inside one
`jax.jit` (`lax.fori_loop`); each round's input depends on the last round's outputs
(x_next = x + 0 * y[:, :1]), so XLA can neither hoist nor drop a call, and no host dispatch sits
between calls. Copies add up to about 3x the L2 cache, so every call streams its weight from HBM
as a decode step does. The figure is the median of several timed calls over reps * copies, with
nothing subtracted. GPU only: the kernels' interpret mode runs their bodies in Python.

`method="kernel"` (the default) instead reads the kernels' own durations from a profiler trace
(specjax/profiling.py) of one timed call: every kernel a GEMM launches (the split-K partial sum
too), no loop overhead. On the lent H100 the loop added ~20 us per iteration, enough to rank the
tile configs of a 30 MB weight by the loop rather than the kernel; `method="loop"` keeps the
host-clock figure for comparison.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

L2_BYTES = 60e6  # H100/H200 L2 is 50-60 MB
TARGET_S = 2e-3  # seconds of kernel work per timed call: well above launch and timer noise


def looped(gemm, reps: int):
    """jit(x, weights): `reps` rounds of `gemm(x, w)` over every copy; x carries the dependency."""
    def run(x, weights):
        def body(_, x):
            ys = [gemm(x, w) for w in weights]
            return x + (sum(y[:, :1] for y in ys) * 0.0).astype(x.dtype)
        return jax.lax.fori_loop(0, reps, body, x)
    return jax.jit(run)


def median_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def random_bits(key, shape, scale: float = 0.02) -> jax.Array:
    """Random bf16 weights as uint16 patterns (normal * scale: a trained matrix's exponent spread)."""
    w = (scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(w, jnp.uint16)


class KernelTimer:
    """time_fn(shape, fmt, config, T) on the GPU present. Weights of a shape are built once (bf16
    copies and their LH12 packing, encoded on the device) and prepared per config."""

    def __init__(self, repeats: int = 5, bandwidth_guess: float = 4e12, seed: int = 0, method: str = "kernel"):
        if method not in ("kernel", "loop"):
            raise ValueError(f"KernelTimer method must be 'kernel' or 'loop', got {method!r}")
        self.repeats, self.bandwidth_guess, self.seed, self.method = repeats, bandwidth_guess, seed, method
        self._weights: dict = {}

    def weights(self, shape: tuple[int, int]):
        if shape not in self._weights:
            from pallas_kernels.skinny_gemm_lh12 import to_stored_order
            from specjax.weights.lh12 import encode_jax
            nbytes = 2 * shape[0] * shape[1]
            copies = max(1, int(np.ceil(3 * L2_BYTES / (0.75 * nbytes))))  # LH12 copies too exceed L2
            keys = jax.random.split(jax.random.PRNGKey(self.seed + shape[0] + shape[1]), copies)
            bits = [random_bits(k, shape) for k in keys]
            # both packings, so no candidate pays an encode: the format's order, and the natural
            # order one-dot configs use where N % 8 == 0 (`natural_order`)
            natural = [encode_jax(to_stored_order(b)) for b in bits] if shape[1] % 8 == 0 else None
            self._weights[shape] = (bits, [encode_jax(b) for b in bits], natural)
        return self._weights[shape]

    def __call__(self, shape: tuple[int, int], fmt: str, config, tokens: int) -> float:
        from pallas_kernels.skinny_gemm import prepare_bf16, skinny_gemm
        from pallas_kernels.skinny_gemm_lh12 import natural_order, prepare_lh12, skinny_gemm_lh12

        bits, packed, natural = self.weights(shape)
        if fmt == "bf16":
            gemm = skinny_gemm
            ws = [prepare_bf16(jax.lax.bitcast_convert_type(b, jnp.bfloat16), config) for b in bits]
        elif fmt == "lh12":
            permuted = natural_order(shape, config)
            ws = [prepare_lh12(p, config, permuted=permuted) for p in (natural if permuted else packed)]
            gemm = skinny_gemm_lh12
        elif fmt == "xla":  # XLA's GEMM on the same bf16 weights: what our kernels are priced against
            gemm, ws = (lambda x, w: x @ w), [jax.lax.bitcast_convert_type(b, jnp.bfloat16) for b in bits]
        else:
            raise ValueError(f"unknown weight format {fmt!r} (bf16, lh12 or xla)")
        per_round = 2 * shape[0] * shape[1] * len(ws) / self.bandwidth_guess
        reps = max(2, int(TARGET_S / per_round))
        x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, shape[0]), jnp.bfloat16)
        if self.method == "kernel":
            from specjax.profiling import kernel_seconds
            reps = max(2, min(reps, 8))  # a short trace: the kernels' own times need no long loop
            return kernel_seconds(looped(gemm, reps), x, ws) / (reps * len(ws))
        return median_seconds(looped(gemm, reps), x, ws, repeats=self.repeats) / (reps * len(ws))
