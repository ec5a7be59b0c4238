"""Prototype: swapped-operand skinny GEMMs in the Triton backend (issue 9's 12-bit lever).

y^T [N, T] = W^T [N, K] @ x^T [K, T]: the weight is the tensor-core A operand (M = output columns,
a multiple of 64, so Triton picks Hopper's wgmma), the activations the B operand (N = 16: T is
padded to 16 by clamped rows, as in pallas_kernels/skinny_gemm.py). A comes from registers when it
is computed rather than loaded: the 12-bit kernel decodes W^T in registers and hands it to wgmma
without writing it back to shared memory, which is what the Mosaic probe (2026-12-05) found makes
the decode affordable.

12-bit layout here ("K-split nibbles"): planes are stored transposed, K contiguous: `lo` uint8
[N, K] (low bytes) and `code` uint8 [N, K / 2] where, in K block b of `block_k`, byte j of a row
holds the 4-bit codes of k = b*bk + j (low nibble) and k = b*bk + bk/2 + j (high nibble). A code is
sign << 3 | (exp>>1 - base) for a weight inside the per-tensor window [base, base + 7], as in LH12.
Each 64-wide K chunk decodes with elementwise ops only (no byte interleave, no reshape), so Triton
can keep the data in the wgmma operand layout from the shared-memory load on. Both kernels run one
dot per 64-wide K chunk, in the same order, so the 12-bit result is bitwise equal to the bf16 twin's.

Escapes: a segment is 64 consecutive k of one output column (one row of W^T, one dot chunk). In an
escape segment the codes hold the low nibble of each high byte and `ov` [n_escape + 1, 64] uint8
(last row zero) the high nibble; `segidx` [K / 64, N] int32 gives each segment's `ov` row or -1.
With `escapes=True` the kernel reads the bn indices of each chunk (a contiguous load) and gathers
`ov` rows only for escaped segments (a masked load), every chunk: on trained weights 50-90% of
128x128 tiles hold an escape (SmolLM2, 2026-12-07), so a per-tile branch would mostly be taken.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TP = 16  # activation rows per dot (wgmma N); rows past T repeat row T - 1
CHUNK = 64  # K per dot, and weights per escape segment


@dataclasses.dataclass(frozen=True)
class SwapConfig:
    block_n: int = 128  # output columns per program (wgmma M)
    block_k: int = 128  # K per step (block_k / 64 dots)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    escapes: bool = False  # 12-bit only: the escape patch (off: escape-free weights only)

    @property
    def tag(self) -> str:
        return (f"n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}_st{self.num_stages}"
                + ("_esc" if self.escapes else ""))


def split_for(k: int, n: int, cfg: SwapConfig, target: int = 264) -> int:
    """A split of K that brings the grid near `target` programs, >= 4 K steps each, dividing K."""
    grid_n = -(-n // cfg.block_n)
    steps = k // cfg.block_k
    split = max(1, min(16, -(-target // grid_n), steps // 4))
    while split > 1 and steps % split:
        split -= 1
    return split


def _x_tile(x_ref, k0, width: int, t: int):
    """[TP, width] activation rows at column k0, rows past t - 1 clamped to t - 1."""
    if t >= TP:
        return x_ref[pl.ds(0, TP), pl.ds(k0, width)]
    rows = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (TP, width), 0), t - 1)
    return x_ref[rows, k0 + jax.lax.broadcasted_iota(jnp.int32, (TP, width), 1)]


def _store(o_ref, acc, n0, bn: int, t: int):
    """acc [bn, TP] -> partial s, rows n0.., columns < t (clamped columns hold copies of t - 1)."""
    rows = n0 + jax.lax.broadcasted_iota(jnp.int32, (bn, TP), 0)
    cols = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (bn, TP), 1), t - 1)
    o_ref[pl.program_id(1), rows, cols] = acc


def _params(cfg: SwapConfig):
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _bf16_kernel(x_ref, w_ref, o_ref, *, cfg: SwapConfig, steps: int, t: int):
    j, s = pl.program_id(0), pl.program_id(1)
    bn, bk = cfg.block_n, cfg.block_k
    n0 = pl.multiple_of(j * bn, bn)

    def step(i, acc):
        k0 = pl.multiple_of((s * steps + i) * bk, bk)
        for c in range(bk // CHUNK):
            kc = pl.multiple_of(k0 + c * CHUNK, CHUNK)
            wt = w_ref[pl.ds(n0, bn), pl.ds(kc, CHUNK)]  # W^T stored [N, K]: A is K-major
            acc = acc + jnp.dot(wt, _x_tile(x_ref, kc, CHUNK, t).T, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bn, TP), jnp.float32))
    _store(o_ref, acc, n0, bn, t)


def _w12_kernel(x_ref, lo_ref, code_ref, segidx_ref, ov_ref, o_ref, *, cfg: SwapConfig, steps: int,
                t: int, base: int, interpret: bool):
    j, s = pl.program_id(0), pl.program_id(1)
    bn, bk = cfg.block_n, cfg.block_k
    pairs = bk // (2 * CHUNK)  # code bytes of chunk c serve chunk c + pairs too
    n0 = pl.multiple_of(j * bn, bn)
    u8, u16 = jnp.uint8, jnp.uint16

    def step(i, acc):
        kb = s * steps + i
        k0 = pl.multiple_of(kb * bk, bk)
        codes = [code_ref[pl.ds(n0, bn), pl.ds(pl.multiple_of(kb * (bk // 2) + p * CHUNK, CHUNK), CHUNK)]
                 for p in range(pairs)]
        for c in range(bk // CHUNK):
            kc = pl.multiple_of(k0 + c * CHUNK, CHUNK)
            lo = lo_ref[pl.ds(n0, bn), pl.ds(kc, CHUNK)]
            code = codes[c % pairs]
            nib = code & u8(15) if c < pairs else code >> u8(4)
            hi = ((nib & u8(7)) + u8(base)) | ((nib & u8(8)) << u8(4))
            if cfg.escapes:
                idx = segidx_ref[kc // CHUNK, pl.ds(n0, bn)]  # [bn]: ov row or -1
                esc = idx >= 0
                rows = jnp.broadcast_to(jnp.maximum(idx, 0)[:, None], (bn, CHUNK))
                cols = jax.lax.broadcasted_iota(jnp.int32, (bn, CHUNK), 1)
                mask = jnp.broadcast_to(esc[:, None], (bn, CHUNK))
                if interpret:  # no masked loads there: row max(idx, 0) exists, the mask selects
                    ovw = ov_ref[rows, cols]
                else:
                    from jax.experimental.pallas import triton as plgpu
                    ovw = plgpu.load(ov_ref.at[rows, cols], mask=mask, other=0)
                hi = jnp.where(mask, nib | (ovw << u8(4)), hi)
            bits = (hi.astype(u16) << u16(8)) | lo.astype(u16)
            wt = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
            acc = acc + jnp.dot(wt, _x_tile(x_ref, kc, CHUNK, t).T, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bn, TP), jnp.float32))
    _store(o_ref, acc, n0, bn, t)


def _finish(partials, n: int):
    y = partials[0]
    for s in range(1, partials.shape[0]):
        y = y + partials[s]
    return y[:n].T


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def gemm_bf16(x, wt, cfg: SwapConfig, interpret: bool = False):
    """x [T, K] @ W, with W given as W^T [N, K] bf16 -> float32 [T, N]."""
    n, k = wt.shape
    t = x.shape[0]
    steps = k // (cfg.block_k * cfg.split_k)
    partials = pl.pallas_call(
        functools.partial(_bf16_kernel, cfg=cfg, steps=steps, t=t),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, n, t), jnp.float32),
        grid=(n // cfg.block_n, cfg.split_k),
        compiler_params=None if interpret else _params(cfg), interpret=interpret,
        name="swapped_gemm_bf16")(x.astype(jnp.bfloat16), wt)
    return _finish(partials, n)


@functools.partial(jax.jit, static_argnames=("base", "cfg", "interpret"))
def gemm_w12(x, planes, base: int, cfg: SwapConfig, interpret: bool = False):
    """x [T, K] @ decode(planes) -> float32 [T, N]; planes (lo, code, segidx, ov) from `encode_ksplit`."""
    lo, code, segidx, ov = planes
    n, k = lo.shape
    t = x.shape[0]
    steps = k // (cfg.block_k * cfg.split_k)
    partials = pl.pallas_call(
        functools.partial(_w12_kernel, cfg=cfg, steps=steps, t=t, base=base, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, n, t), jnp.float32),
        grid=(n // cfg.block_n, cfg.split_k),
        compiler_params=None if interpret else _params(cfg), interpret=interpret,
        name="swapped_gemm_w12")(x.astype(jnp.bfloat16), lo, code, segidx, ov)
    return _finish(partials, n)


def escape_free(key, shape_nk, scale: float = 0.02):
    """W^T [N, K] bf16, every |w| in [2^-13, 4): one 16-exponent window (base 57)."""
    w = scale * jax.random.normal(key, shape_nk, jnp.float32)
    w = jnp.sign(w) * jnp.clip(jnp.abs(w), 2.0 ** -13, 3.99)
    return jnp.where(w == 0, 2.0 ** -13, w).astype(jnp.bfloat16)


def encode_ksplit(wt, block_k: int):
    """W^T [N, K] bf16 (any bit patterns) -> ((lo, code, segidx, ov), base, escaped segments).
    The base is the one that leaves the fewest escape segments (as LH12 chooses it)."""
    bits = jax.lax.bitcast_convert_type(wt, jnp.uint16)
    n, k = wt.shape
    hi = (bits >> 8).astype(jnp.int32)
    e2 = hi & 0x7F
    segs = e2.reshape(n, k // CHUNK, CHUNK)
    smin, smax = segs.min(-1), segs.max(-1)
    bases = jnp.arange(121)
    covered = jnp.sum((smin[..., None] >= bases) & (smax[..., None] <= bases + 7), axis=(0, 1))
    base = int(jnp.argmax(covered))
    esc_seg = ~((smin >= base) & (smax <= base + 7))  # [N, K/64]
    esc_w = jnp.repeat(esc_seg, CHUNK, axis=1)
    nib = jnp.where(esc_w, hi & 0xF, (jnp.clip(e2 - base, 0, 7)) | ((hi >> 7) << 3)).astype(jnp.uint8)
    nb = nib.reshape(n, k // block_k, 2, block_k // 2)
    code = (nb[:, :, 0] | (nb[:, :, 1] << 4)).reshape(n, k // 2)
    n_esc = int(jnp.sum(esc_seg))
    order = jnp.cumsum(esc_seg.T.reshape(-1)) - 1  # ov rows in (kseg, n) order
    segidx = jnp.where(esc_seg.T.reshape(-1), order, -1).reshape(k // CHUNK, n).astype(jnp.int32)
    which = jnp.nonzero(esc_seg.T.reshape(-1), size=n_esc)[0]
    hi_nib = (hi >> 4).astype(jnp.uint8).reshape(n, k // CHUNK, CHUNK).transpose(1, 0, 2).reshape(-1, CHUNK)
    ov = jnp.concatenate([hi_nib[which], jnp.zeros((1, CHUNK), jnp.uint8)])
    return (bits & 0xFF).astype(jnp.uint8), code, segidx, ov, base, n_esc


def reference(x, wt):
    return jnp.dot(x.astype(jnp.bfloat16), wt.T, preferred_element_type=jnp.float32)


def _decode_reference(lo, code, segidx, ov, base: int, block_k: int):
    """The planes back to W^T bits, in plain JAX (checks the encoder)."""
    n, k = lo.shape
    c = code.reshape(n, k // block_k, 1, block_k // 2)
    nib = jnp.concatenate([c & 15, c >> 4], axis=2).reshape(n, k).astype(jnp.int32)
    hi = ((nib & 7) + base) | ((nib & 8) << 4)
    idx = jnp.repeat(segidx.T, CHUNK, axis=1)
    ovw = ov[jnp.maximum(idx, 0), jnp.arange(k)[None, :] % CHUNK].astype(jnp.int32)
    hi = jnp.where(idx >= 0, nib | (ovw << 4), hi)
    return (hi << 8 | lo.astype(jnp.int32)).astype(jnp.uint16)


if __name__ == "__main__":  # CPU check: the encoder round-trips; the kernels agree in interpret mode
    n, k = 128, 512
    cfg = SwapConfig(block_n=64, block_k=128, split_k=2)
    w = escape_free(jax.random.PRNGKey(0), (n, k))
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    special = jnp.array([0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC1, 0x3F80, 0x0080], jnp.uint16)
    pos = jax.random.randint(jax.random.PRNGKey(1), (40, 2), 0, jnp.array([n, k]))
    bits = bits.at[pos[:, 0], pos[:, 1]].set(special[jnp.arange(40) % 8])
    wt = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    lo, code, segidx, ov, base, n_esc = encode_ksplit(wt, cfg.block_k)
    assert bool(jnp.all(_decode_reference(lo, code, segidx, ov, base, cfg.block_k) == bits))
    print("encoder round-trips;", n_esc, "escape segments of", n * k // CHUNK)
    finite = jnp.isfinite(wt.astype(jnp.float32))
    wt_f = jnp.where(finite, wt, jnp.bfloat16(0))  # the dot check wants finite weights
    planes_f = encode_ksplit(wt_f, cfg.block_k)
    for t in (1, 5, 16):
        x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.float32)
        y16 = gemm_bf16(x, wt_f, cfg, interpret=True)
        err = float(jnp.max(jnp.abs(y16 - reference(x, wt_f))))
        assert err < 1e-3, err
        for esc in (False, True):
            if not esc and planes_f[5]:
                continue  # the escape-free kernel needs escape-free weights
            y12 = gemm_w12(x, planes_f[:4], planes_f[4], dataclasses.replace(cfg, escapes=esc), interpret=True)
            assert bool(jnp.all(y12 == y16)), (t, esc)
        ef = encode_ksplit(w, cfg.block_k)
        assert ef[5] == 0
        y12 = gemm_w12(x, ef[:4], ef[4], cfg, interpret=True)
        assert bool(jnp.all(y12 == gemm_bf16(x, w, cfg, interpret=True))), t
        print(t, "bf16 max err vs reference", err, "; 12-bit bitwise equal, with and without escapes")
