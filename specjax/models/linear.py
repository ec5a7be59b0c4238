"""`linear(x, w)`: the one matmul of the dense decoder, dispatched on what the weight is.

- a plain array [in, out]: XLA (`x @ w`), as on CPU and for float32 models;
- a `GemmWeight` (bf16) or `Lh12GemmWeight` (12-bit): the Pallas skinny GEMMs for up to
  `SLAB * MAX_SLABS` rows (decode, verify), in slabs of `SLAB` rows so a row's result never depends
  on how many rows came with it (AR steps and verify steps agree bit for bit); beyond that
  (prefill) XLA over the dense bf16 matrix, which AR and speculative decoding share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.skinny_gemm import GemmWeight, skinny_gemm, unprepare_bf16
from pallas_kernels.skinny_gemm_lh12 import Lh12GemmWeight, dense_lh12, skinny_gemm_lh12
from specjax.sharding.tp_kernels import TPGemmWeight, tp_gemm
from specjax.sharding.tp_lh12 import TPLh12Weight, dense_tp_lh12, tp_gemm_lh12

SLAB = 64  # rows per kernel call: 4 tensor-core row chunks, what the accumulators fit
MAX_SLABS = 16  # more rows: XLA (the weights are read once per slab). 16: a batch of 32 verifying
# trees of 16 nodes (544 rows) stays on the kernels, so it rounds as its AR steps do

KernelWeight = GemmWeight | Lh12GemmWeight | TPGemmWeight | TPLh12Weight
_GEMMS = {GemmWeight: skinny_gemm, Lh12GemmWeight: skinny_gemm_lh12, TPGemmWeight: tp_gemm,
          TPLh12Weight: tp_gemm_lh12}


def is_kernel_weight(w) -> bool:
    return isinstance(w, tuple(_GEMMS))


def dense(w) -> jax.Array:
    """The weight as a plain [in, out] array (bf16 for kernel weights)."""
    if isinstance(w, GemmWeight):
        return unprepare_bf16(w)
    if isinstance(w, Lh12GemmWeight):
        return dense_lh12(w)
    if isinstance(w, TPGemmWeight):
        return w.w  # sharded: XLA partitions the dense GEMM itself
    if isinstance(w, TPLh12Weight):
        return dense_tp_lh12(w)
    return w


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w -> [..., out] in x's dtype."""
    if not is_kernel_weight(w):
        return x @ w
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    x2 = x.reshape(rows, k)
    if rows > SLAB * MAX_SLABS:
        y = jnp.dot(x2.astype(jnp.bfloat16), dense(w), preferred_element_type=jnp.float32)
    else:
        gemm = _GEMMS[type(w)]
        y = jnp.concatenate([gemm(x2[i:i + SLAB], w) for i in range(0, rows, SLAB)], axis=0)
    return y.astype(x.dtype).reshape(*lead, w.shape[1])
