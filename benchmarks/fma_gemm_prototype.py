"""Prototype: skinny GEMMs on the FP32 pipes (no tensor cores) for T <= 16 rows (issue 9's 12-bit lever).

y[T, N] = x[T, K] @ W[K, N], one weight row at a time: a program owns a set of output columns and a
1/split share of K, and for each row k of W in order does acc[t, n] += x[t, k] * w[k, n] in float32.
Every column is a plain sequence of multiply-adds in k order, then the split partials are added in
order: no reduction across threads and no tensor-core operand layout anywhere, so
- the result of row t does not depend on T (AR and verify steps agree bit for bit), and
- the 12-bit kernel, which decodes its weights in registers from 32-bit words (SWAR, four weights
  per word operation, straight to float32 bit patterns: a bf16 is the top half of its float32), runs
  the same arithmetic per column as the bf16 kernel and gives bitwise equal outputs.
The engine's kernels (pallas_kernels/skinny_gemm*.py) must feed mma.sync, which in Triton means a
round trip of the decoded tile through shared memory (docs/notes/perf.md, session 17); here the
decode stays in the load's own layout. The price: T multiply-adds per weight on the CUDA cores, so
the kernel is for narrow steps (AR, chains of k <= 7), not for T = 64.

12-bit planes are LH12's (specjax/weights/lh12.py): `code` [K, M] and `lo` [K, 2M] uint32 words,
element i of super-word m being column i M + m (stripe i). This prototype takes escape-free weights
only (the engine's escape patch would come with wiring it in).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.skinny_gemm_lh12 import high_bytes
from specjax.weights.lh12 import Packed12

_U32 = np.uint32
STRIPES = 8


@dataclasses.dataclass(frozen=True)
class FmaConfig:
    block_m: int = 128  # columns per stripe per program (the bf16 kernel: 8 * block_m contiguous)
    split_k: int = 8  # programs along K, partials added in order (numerics)
    unroll: int = 4  # weight rows per loop iteration (speed only)
    num_warps: int = 4
    num_stages: int = 3

    @property
    def block_n(self) -> int:
        return STRIPES * self.block_m

    @property
    def tag(self) -> str:
        return f"m{self.block_m}_s{self.split_k}_u{self.unroll}_w{self.num_warps}_st{self.num_stages}"


def split_for(k: int, n: int, cfg: FmaConfig, target: int = 264) -> int:
    """A split of K near `target` programs that divides K into whole loop iterations."""
    grid_n = -(-n // cfg.block_n)
    split = max(1, min(32, -(-target // grid_n)))
    while split > 1 and (k % split or (k // split) % cfg.unroll):
        split -= 1
    return split


def _params(cfg: FmaConfig, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _as_f32(bits):
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _fma(acc, x_col, w_row):
    """The one multiply-add both kernels run: acc [T, c] + x [T, 1] * w [1, c], float32."""
    return acc + x_col * w_row


def _rows(body, steps: int, unroll: int, init):
    """body(row, carry) for row = 0 .. steps - 1 in order, `unroll` rows per loop iteration."""
    def it(i, carry):
        for u in range(unroll):
            carry = body(i * unroll + u, carry)
        return carry
    return jax.lax.fori_loop(0, steps // unroll, it, init)


def _bf16_kernel(x_ref, w_ref, o_ref, *, steps, unroll):
    def body(r, acc):
        x = x_ref[:, pl.ds(r, 1)].astype(jnp.float32)
        return _fma(acc, x, w_ref[pl.ds(r, 1), :].astype(jnp.float32))
    o_ref[...] = _rows(body, steps, unroll, jnp.zeros(o_ref.shape, jnp.float32))


def _w12_kernel(x_ref, code_ref, lo_a_ref, lo_b_ref, o_ref, *, steps, unroll, base):
    def body(r, accs):
        x = x_ref[:, pl.ds(r, 1)].astype(jnp.float32)
        ha, hb = high_bytes(code_ref[pl.ds(r, 1), :], _U32(base * 0x01010101))
        vals = []
        for low, high in ((lo_a_ref[pl.ds(r, 1), :], ha), (lo_b_ref[pl.ds(r, 1), :], hb)):
            w02 = (low & _U32(0x00FF00FF)) | ((high << 8) & _U32(0xFF00FF00))  # bf16x2 {e0, e2}
            w13 = ((low >> 8) & _U32(0x00FF00FF)) | (high & _U32(0xFF00FF00))  # {e1, e3}
            # a bf16 in the top half of a word is that value as float32
            vals += [w02 << 16, w13 << 16, w02 & _U32(0xFFFF0000), w13 & _U32(0xFFFF0000)]
        return tuple(_fma(a, x, _as_f32(v)) for a, v in zip(accs, vals))
    zeros = jnp.zeros((o_ref.shape[0], o_ref.shape[2]), jnp.float32)
    accs = _rows(body, steps, unroll, (zeros,) * STRIPES)
    for i in range(STRIPES):
        o_ref[:, i, :] = accs[i]


def _pad_rows(x):
    t = x.shape[0]
    tp = max(1, 1 << (t - 1).bit_length())
    return jnp.pad(x, ((0, tp - t), (0, 0))), t


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def gemm_bf16(x, w, cfg: FmaConfig, interpret: bool = False):
    """x [T, K] bf16, W [K, N] bf16 -> [T, N] float32 (N % (8 block_m) == 0, K % split == 0)."""
    (k, n), (xp, t) = w.shape, _pad_rows(x)
    ks = k // cfg.split_k
    parts = pl.pallas_call(
        functools.partial(_bf16_kernel, steps=ks, unroll=cfg.unroll),
        grid=(n // cfg.block_n, cfg.split_k),
        in_specs=[pl.BlockSpec((xp.shape[0], ks), lambda j, s: (0, s)),
                  pl.BlockSpec((ks, cfg.block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((None, xp.shape[0], cfg.block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, xp.shape[0], n), jnp.float32),
        compiler_params=_params(cfg, interpret), interpret=interpret)(xp, w)
    return _sum_parts(parts)[:t]


@functools.partial(jax.jit, static_argnames=("base", "cfg", "interpret"))
def gemm_w12(x, code, lo, base: int, cfg: FmaConfig, interpret: bool = False):
    """x [T, K] bf16, LH12 planes of an escape-free W [K, N] (code [K, M], lo [K, 2M], N = 8M)."""
    (k, m), (xp, t) = code.shape, _pad_rows(x)
    ks, mb = k // cfg.split_k, m // cfg.block_m
    parts = pl.pallas_call(
        functools.partial(_w12_kernel, steps=ks, unroll=cfg.unroll, base=base),
        grid=(mb, cfg.split_k),
        in_specs=[pl.BlockSpec((xp.shape[0], ks), lambda j, s: (0, s)),
                  pl.BlockSpec((ks, cfg.block_m), lambda j, s: (s, j)),
                  pl.BlockSpec((ks, cfg.block_m), lambda j, s: (s, j)),
                  pl.BlockSpec((ks, cfg.block_m), lambda j, s: (s, j + mb))],
        out_specs=pl.BlockSpec((None, xp.shape[0], STRIPES, cfg.block_m), lambda j, s: (s, 0, 0, j)),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, xp.shape[0], STRIPES, m), jnp.float32),
        compiler_params=_params(cfg, interpret), interpret=interpret)(xp, code, lo, lo)
    return _sum_parts(parts.reshape(cfg.split_k, xp.shape[0], STRIPES * m))[:t]


def _sum_parts(parts):
    """Split partials added in order (the same program for both kernels' partials)."""
    out = parts[0]
    for i in range(1, parts.shape[0]):
        out = out + parts[i]
    return out


def reference(x, w, split_k: int):
    """Pure JAX: per column, multiply-adds in k order within each split, partials added in order."""
    k = w.shape[0]
    ks = k // split_k
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)

    def part(s):
        def body(r, acc):
            kk = s * ks + r
            return _fma(acc, jax.lax.dynamic_slice_in_dim(xf, kk, 1, 1),
                        jax.lax.dynamic_slice_in_dim(wf, kk, 1, 0))
        return jax.lax.fori_loop(0, ks, body, jnp.zeros((x.shape[0], w.shape[1]), jnp.float32))
    return _sum_parts(jnp.stack([part(s) for s in range(split_k)]))


def escape_free(key, shape, scale: float = 0.02):
    """W [K, N] bf16 with every |w| in [2^-13, 4): one 16-exponent window, no escape segment."""
    w = scale * jax.random.normal(key, shape, jnp.float32)
    w = jnp.sign(w) * jnp.clip(jnp.abs(w), 2.0 ** -13, 3.99)
    return jnp.where(w == 0, 2.0 ** -13, w).astype(jnp.bfloat16)


def encode(w) -> tuple[jax.Array, jax.Array, int]:
    """W [K, N] bf16, escape-free -> (code [K, M], lo [K, 2M], base) as LH12 lays them out."""
    from specjax.weights.lh12 import encode_jax
    p: Packed12 = encode_jax(jax.lax.bitcast_convert_type(w, jnp.uint16))
    if int(np.asarray(p.flag).any()):
        raise ValueError("escape-free prototype: these weights have escape segments")
    return jnp.asarray(p.code, jnp.uint32), jnp.asarray(p.lo, jnp.uint32), int(p.base)


if __name__ == "__main__":  # interpret-mode self-check on the CPU
    for (k, n, t), cfg in [((64, 256, 1), FmaConfig(16, 2, 2)), ((128, 512, 3), FmaConfig(32, 4, 4)),
                           ((64, 256, 16), FmaConfig(32, 1, 8))]:
        w = escape_free(jax.random.PRNGKey(k + n), (k, n))
        x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.float32).astype(jnp.bfloat16)
        code, lo, base = encode(w)
        y16 = gemm_bf16(x, w, cfg, interpret=True)
        y12 = gemm_w12(x, code, lo, base, cfg, interpret=True)
        ref = reference(x, w, cfg.split_k)
        y1 = gemm_bf16(x[:1], w, cfg, interpret=True)
        print(k, n, t, cfg.tag, "bf16==ref", bool(jnp.all(y16 == ref)), "w12==bf16", bool(jnp.all(y12 == y16)),
              "row0(T=1)==row0(T)", bool(jnp.all(y1[0] == y16[0])),
              "max|y-xla|", float(jnp.max(jnp.abs(y16 - x.astype(jnp.float32) @ w.astype(jnp.float32)))))
