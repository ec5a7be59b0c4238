"""Skinny GEMM over LH12 (lossless 12-bit) weights, decoded in registers: no bf16 copy in HBM.

Per K step a program loads a [block_k, block_m] block of the `code` plane and of each `lo` half
(12 bits per weight), rebuilds the high bytes four at a time (SWAR on 32-bit words), interleaves
them with the low bytes into bf16 pairs, and splits those into the 8 stripe tiles that
skinny_gemm.py reads from a plain bf16 matrix. The dots, their order and the split-K sum are
shared with that kernel (`chunked_dots`, `finish`), so on the same weights both give bitwise
equal outputs: a 12-bit target yields exactly the bf16 target's tokens.

Escapes (segments outside the exponent window) are patched before the multiply, never after:
a per-tile escape count (computed when the weight is prepared) selects the path that looks up
each super-word's flag bit, its rank (ovbase + popcount) and its overflow word, as
`specjax.weights.lh12.decode_jax` does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.skinny_gemm import (ROW_CHUNK, STRIPES, GemmConfig, Geometry, as_operand,
                                        check_layout, chunked_dots, compiler_params, finish, row_base,
                                        row_chunks, row_grid, store_accs, store_wide, sum_partials,
                                        x_chunks)
from specjax.weights.lh12 import LAYOUT, Packed12, decode_jax, encode_jax

_U32 = np.uint32
SEG_WORDS = LAYOUT.segment // LAYOUT.group  # super-words per escape segment (8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)
class Lh12GemmWeight:
    """LH12 planes laid out for `skinny_gemm_lh12` (padded to the config's blocks)."""

    code: jax.Array  # [Kp, Mp] uint32
    lo: jax.Array  # [Kp, 2 * Mp] uint32: elements 0-3 at [0, Mp), 4-7 at [Mp, 2 Mp)
    flag: jax.Array  # [nf] uint32, zero past the tensor so padded rows never escape
    ovbase: jax.Array  # [nf] uint32
    ov: jax.Array  # [8 * rows] uint32, flat: n_escape rows, then zero rows (the last is the sentinel)
    tile_escapes: jax.Array  # [Kp / block_k, Mp / block_m] int32: escape super-words per tile
    # [1] uint32: base * 0x01010101. Data, not a static kernel parameter, and `ov` padded to a
    # power-of-two row count: tensors of one shape then share one compiled kernel (a kernel per
    # tensor cost ~7 minutes of Triton compiles for SmolLM2's 120 matrices on the H200, 2026-12-07)
    base_word: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    base: int = dataclasses.field(metadata=dict(static=True))
    config: GemmConfig = dataclasses.field(metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the planes encode W[:, to_stored_order] (see `natural_order`): the kernel's output columns
    # come out in natural order, with no transpose after the GEMM
    natural: bool = dataclasses.field(default=False, metadata=dict(static=True))
    n_escape: int = dataclasses.field(default=-1, metadata=dict(static=True))  # -1: ov has no zero padding

    @property
    def segments_per_row(self) -> int:
        return -(-self.shape[1] // LAYOUT.segment)

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM streams (planes and escape data; not the per-tile counts)."""
        return sum(int(a.size) * 4 for a in (self.code, self.lo, self.flag, self.ovbase, self.ov))


def escaped_superwords(p: Packed12) -> np.ndarray:
    """[K, M] bool: super-words in escape segments."""
    rows, cols = p.shape
    segs = -(-cols // LAYOUT.segment)
    m = -(-cols // LAYOUT.group)
    flags = np.unpackbits(np.asarray(p.flag).view(np.uint8), bitorder="little")[:rows * segs]
    return np.repeat(flags.reshape(rows, segs).astype(bool), SEG_WORDS, axis=1)[:, :m]


def natural_order(shape: tuple[int, int], config: GemmConfig) -> bool:
    """A one-dot kernel writes output column 8 m + i from stored position 8 m + i, which LH12 maps
    to column i * M + m (stripe i): in the format's order a transpose must follow each GEMM (at
    T = 64 it cost ~1 ms of an 8B step on the H100, 2026-12-06). Packing W[:, to_stored_order]
    instead puts column 8 m + i of W at stored position 8 m + i, so the output is in natural order.
    Needs N % 8 == 0 (M = N / 8, no pad columns inside the stripes)."""
    return config.one_dot and shape[1] % STRIPES == 0


def to_stored_order(bits: jax.Array) -> jax.Array:
    """W [K, N] -> W' with W'[:, i * M + m] = W[:, 8 m + i] (N % 8 == 0)."""
    k, n = bits.shape
    return bits.reshape(k, n // STRIPES, STRIPES).transpose(0, 2, 1).reshape(k, n)


def from_stored_order(bits: jax.Array) -> jax.Array:
    """Inverse of `to_stored_order`."""
    k, n = bits.shape
    return bits.reshape(k, STRIPES, n // STRIPES).transpose(0, 2, 1).reshape(k, n)


def pack_for_kernel(bits: jax.Array, config: GemmConfig) -> tuple[Packed12, bool]:
    """bf16 bit patterns [K, N] -> (planes for `prepare_lh12`, permuted): encoded in the kernel's
    natural order where `natural_order` allows."""
    permuted = natural_order(tuple(bits.shape), config)
    return encode_jax(to_stored_order(bits) if permuted else bits), permuted


def prepare_lh12(p: Packed12, config: GemmConfig, interpret: bool = False,
                 permuted: bool = False) -> Lh12GemmWeight:
    """Pad a tensor's planes to the config's blocks and count escapes per tile. `p` holds W's planes,
    or, with `permuted`, those of W[:, to_stored_order] (`pack_for_kernel`); where `natural_order`
    holds and `p` is not permuted yet, it is decoded, permuted and encoded again here."""
    check_layout(p.shape, config, "lh12")
    natural = natural_order(p.shape, config)
    if permuted and not natural:
        raise ValueError(f"planes permuted for natural order, but {config} on {p.shape} cannot use it")
    if natural and not permuted:
        p = encode_jax(to_stored_order(decode_jax(p)))
    g = Geometry.of(p.shape, config)
    segs = -(-p.shape[1] // LAYOUT.segment)
    pad2 = lambda a: jnp.pad(jnp.asarray(a, jnp.uint32), ((0, g.kp - g.k), (0, g.mp - g.m)))
    lo = jnp.asarray(p.lo, jnp.uint32)
    nf = (g.kp * segs + g.mp // SEG_WORDS) // LAYOUT.flag_bits + 2  # every g a padded tile forms
    pad1 = lambda a: jnp.pad(jnp.asarray(a, jnp.uint32), (0, nf - a.shape[0]))
    esc = np.pad(escaped_superwords(p), ((0, g.kp - g.k), (0, g.mp - g.m)))
    tiles = esc.reshape(g.kp // config.block_k, config.block_k, g.mp // config.block_m, config.block_m)
    return Lh12GemmWeight(
        code=pad2(p.code), lo=jnp.concatenate([pad2(lo[:, :g.m]), pad2(lo[:, g.m:])], axis=1),
        flag=pad1(p.flag), ovbase=pad1(p.ovbase),
        ov=jnp.pad(jnp.asarray(p.ov, jnp.uint32).reshape(-1), (0, SEG_WORDS * (ov_rows(p.n_escape) - p.n_escape))),
        tile_escapes=jnp.asarray(tiles.sum(axis=(1, 3)), jnp.int32), base_word=base_word(p.base),
        shape=p.shape, base=p.base, config=config, interpret=interpret, natural=natural, n_escape=p.n_escape)


def ov_rows(n_escape: int) -> int:
    """Rows of the padded overflow plane: a power of two with room for the zero sentinel."""
    return 1 << n_escape.bit_length()


def base_word(base: int) -> jax.Array:
    return jnp.full((1,), base * 0x01010101, jnp.uint32)


def high_bytes(code, b4):
    """Code words -> high bytes of elements 0-3 (ha) and 4-7 (hb), four per word; b4 is the
    window base in every byte (base * 0x01010101). H = sign << 7 | (base + offset); base + 7 <= 127,
    so the byte-wise add never carries."""
    ha = ((code & _U32(0x07070707)) + b4) | ((code << 4) & _U32(0x80808080))
    hb = (((code >> 4) & _U32(0x07070707)) + b4) | (code & _U32(0x80808080))
    return ha, hb


def stripe_tiles(lo_a, lo_b, ha, hb):
    """Low and high bytes (4 per word) -> the 8 stripe tiles as bf16, element i -> stripe i."""
    tiles = [None] * STRIPES
    for half, (low, high) in enumerate(((lo_a, ha), (lo_b, hb))):
        w02 = (low & _U32(0x00FF00FF)) | ((high << 8) & _U32(0xFF00FF00))  # bf16x2 {e0, e2}
        w13 = ((low >> 8) & _U32(0x00FF00FF)) | (high & _U32(0xFF00FF00))  # {e1, e3}
        for i, bits in enumerate((w02 & _U32(0xFFFF), w13 & _U32(0xFFFF), w02 >> 16, w13 >> 16)):
            tiles[4 * half + i] = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
    return tiles


# PRMT builds a bf16 pair from a low-byte word and a high-byte word in one instruction: bytes
# {L0, H0, L2, H2} (selector 0x6240) and {L1, H1, L3, H3} (0x7351), where the SWAR masks take
# 8 instructions per pair of pairs. (One result per asm: Pallas lowers no multi-result asm.)
def _prmt(low, high, selector: int):
    from jax.experimental.pallas import triton as plgpu  # inline PTX: a Triton-backend op
    return plgpu.elementwise_inline_asm(
        f"prmt.b32 $0, $1, $2, {selector:#06x};", args=[low, high], constraints="=r,r,r", pack=1,
        # int32, not uint32: Pallas types uint32 results `ui32`, which Triton's asm op rejects
        result_shape_dtypes=[jax.ShapeDtypeStruct(low.shape, jnp.int32)])[0].astype(jnp.uint32)


def stripe_tiles_prmt(lo_a, lo_b, ha, hb):
    """`stripe_tiles` with the byte interleave in PTX prmt (GPU only): the same 8 tiles, bitwise."""
    tiles = [None] * STRIPES
    for half, (low, high) in enumerate(((lo_a, ha), (lo_b, hb))):
        w02, w13 = _prmt(low, high, 0x6240), _prmt(low, high, 0x7351)
        for i, bits in enumerate((w02 & _U32(0xFFFF), w13 & _U32(0xFFFF), w02 >> 16, w13 >> 16)):
            tiles[4 * half + i] = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
    return tiles


def interleave_tiles(tiles):
    """8 stripe tiles [bk, bm] -> one [bk, 8 * bm] tile whose column 8 m + i is tiles[i][:, m]
    (super-word order), built from 2-way joins: the only concatenation Triton lowers."""
    def join(a, b):
        return jnp.stack([a, b], axis=-1)
    level = list(tiles)  # round r joins (t[i], t[i + half]): the last round's bit ends innermost
    while len(level) > 1:
        half = len(level) // 2
        level = [join(level[i], level[i + half]) for i in range(half)]
    bk, bm = tiles[0].shape
    return level[0].reshape(bk, STRIPES * bm)


def popcount(x):
    """Set bits per uint32 in plain integer ops (Pallas' Triton lowering has no ctpop)."""
    x = x - ((x >> 1) & _U32(0x55555555))
    x = (x & _U32(0x33333333)) + ((x >> 2) & _U32(0x33333333))
    x = (x + (x >> 4)) & _U32(0x0F0F0F0F)
    return (x * _U32(0x01010101)) >> 24


def escaped_high_bytes(esc, ovw, code, ha, hb):
    """In escape segments the code holds H's low nibble and the overflow word its high nibble."""
    ha = jnp.where(esc, (code & _U32(0x0F0F0F0F)) | ((ovw << 4) & _U32(0xF0F0F0F0)), ha)
    hb = jnp.where(esc, ((code >> 4) & _U32(0x0F0F0F0F)) | (ovw & _U32(0xF0F0F0F0)), hb)
    return ha, hb


def _lh12_kernel(x_ref, code_ref, lo_ref, flag_ref, ovbase_ref, ov_ref, esc_ref, base_ref, o_ref, *,
                 g: Geometry, cfg: GemmConfig, segs: int, t: int,
                 interpret: bool):
    j, s, r0 = pl.program_id(0), pl.program_id(1), row_base(t)
    bk, bm = cfg.block_k, cfg.block_m
    m0 = pl.multiple_of(j * bm, bm)

    def patch(k0, code, ha, hb):
        """High bytes of escape segments from the overflow nibbles (the rare path)."""
        r = (k0 + jax.lax.broadcasted_iota(jnp.int32, (bk, bm), 0)).astype(jnp.uint32)
        m = (m0 + jax.lax.broadcasted_iota(jnp.int32, (bk, bm), 1)).astype(jnp.uint32)
        seg = r * _U32(segs) + (m >> 3)
        word = flag_ref[(seg >> 5).astype(jnp.int32)]
        bit = seg & _U32(31)
        esc = ((word >> bit) & _U32(1)) == _U32(1)
        rank = ovbase_ref[(seg >> 5).astype(jnp.int32)] + popcount(
            word & ((_U32(1) << bit) - _U32(1)))
        sentinel = _U32(ov_ref.shape[0] - SEG_WORDS)
        ovw = ov_ref[jnp.where(esc, rank * _U32(SEG_WORDS) + (m & _U32(7)), sentinel).astype(jnp.int32)]
        return escaped_high_bytes(esc, ovw, code, ha, hb)

    def patch_by_segment(k0, code, ha, hb, masked: bool):
        """`patch` with the flag, rank and ovbase lookups done once per segment (8 super-words),
        then broadcast along the row: an eighth of the lookups, one extra reshape. `masked`
        predicates the overflow-word gather off outside escape segments (most of the tile)."""
        nseg = bm // SEG_WORDS
        r = (k0 + jax.lax.broadcasted_iota(jnp.int32, (bk, nseg), 0)).astype(jnp.uint32)
        sg = (m0 // SEG_WORDS + jax.lax.broadcasted_iota(jnp.int32, (bk, nseg), 1)).astype(jnp.uint32)
        seg = r * _U32(segs) + sg
        word = flag_ref[(seg >> 5).astype(jnp.int32)]
        bit = seg & _U32(31)
        esc = ((word >> bit) & _U32(1)) == _U32(1)
        rank = ovbase_ref[(seg >> 5).astype(jnp.int32)] + popcount(
            word & ((_U32(1) << bit) - _U32(1)))
        sentinel = _U32(ov_ref.shape[0] - SEG_WORDS)
        first = jnp.where(esc, rank * _U32(SEG_WORDS), sentinel)
        first = jnp.broadcast_to(first[:, :, None], (bk, nseg, SEG_WORDS)).reshape(bk, bm)
        within = jax.lax.broadcasted_iota(jnp.int32, (bk, bm), 1).astype(jnp.uint32) & _U32(7)
        esc = first != sentinel
        if masked:
            from jax.experimental.pallas import triton as plgpu  # masked loads: a Triton-backend op
            ovw = plgpu.load(ov_ref.at[(first + within).astype(jnp.int32)], mask=esc, other=0)
        else:
            ovw = ov_ref[(first + within).astype(jnp.int32)]
        return escaped_high_bytes(esc, ovw, code, ha, hb)

    def step(i, accs):
        kb = s * g.steps + i
        k0 = pl.multiple_of(kb * bk, bk)
        code = code_ref[pl.ds(k0, bk), pl.ds(m0, bm)]
        lo_a = lo_ref[pl.ds(k0, bk), pl.ds(m0, bm)]
        lo_b = lo_ref[pl.ds(k0, bk), pl.ds(pl.multiple_of(g.mp + m0, bm), bm)]
        ha, hb = high_bytes(code, base_ref[0])
        fix = {"superword": patch,
               "segment": functools.partial(patch_by_segment, masked=False),
               "masked": functools.partial(patch_by_segment, masked=True)}[cfg.escape_lookup]
        ha, hb = jax.lax.cond(esc_ref[kb, j] > 0, lambda: fix(k0, code, ha, hb), lambda: (ha, hb))
        # interpret mode (CPU) has no inline PTX: it runs the SWAR form, bitwise the same
        interleave = stripe_tiles_prmt if cfg.decode == "prmt" and not interpret else stripe_tiles
        tiles = interleave(lo_a, lo_b, ha, hb)
        if cfg.one_dot:
            tiles = [interleave_tiles(tiles)]
        return chunked_dots(x_chunks(x_ref, k0, cfg, t, r0), tiles, accs)

    width = cfg.block_n if cfg.one_dot else bm
    zero = jnp.zeros((ROW_CHUNK, width), jnp.float32)
    accs = jax.lax.fori_loop(0, g.steps, step, (zero,) * ((1 if cfg.one_dot else STRIPES) * row_chunks(t)))
    if cfg.one_dot:  # partials in super-word order: column 8 m + i is output column i * Mp + m
        store_wide(o_ref, accs, cfg, t)
    else:
        store_accs(o_ref, accs, g, cfg, t)


def skinny_gemm_lh12(x: jax.Array, lw: Lh12GemmWeight) -> jax.Array:
    """x [T, K] (used as bf16) @ decode(W) -> float32 [T, N], bitwise equal to `skinny_gemm` on the
    decoded weight under a config with the same `numerics`. The kernel reads neither `base` nor
    `n_escape` as static values, so they are cleared before the jit: every tensor of one shape,
    config and overflow bucket is then one trace and one kernel."""
    return _skinny_gemm_lh12(x, dataclasses.replace(lw, base=0, n_escape=-1))


@jax.jit
def _skinny_gemm_lh12(x: jax.Array, lw: Lh12GemmWeight) -> jax.Array:
    g = Geometry.of(lw.shape, lw.config)
    if x.ndim != 2 or x.shape[1] != g.k:
        raise ValueError(f"skinny_gemm_lh12: x is {list(x.shape)}, weight is {list(lw.shape)}")
    t = x.shape[0]
    cfg = lw.config.for_rows(t)
    kernel = functools.partial(_lh12_kernel, g=g, cfg=cfg, segs=lw.segments_per_row,
                               t=t, interpret=lw.interpret)
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, t, STRIPES * g.mp), jnp.float32),
        grid=(g.mp // cfg.block_m, cfg.split_k) + row_grid(t),
        compiler_params=compiler_params(cfg, lw.interpret),
        interpret=lw.interpret,
        name="skinny_gemm_lh12",
    )(as_operand(x, g), lw.code, lw.lo, lw.flag, lw.ovbase, lw.ov, lw.tile_escapes, lw.base_word)
    if lw.natural:  # stored order is W's own column order
        y = sum_partials(partials)
        return y if STRIPES * g.mp == g.n else y[:, :g.n]
    if cfg.one_dot:  # super-word order -> stripe order, fused by XLA into the split-K sum
        partials = partials.reshape(cfg.split_k, t, g.mp, STRIPES).transpose(0, 1, 3, 2)
        partials = partials.reshape(cfg.split_k, t, STRIPES * g.mp)
    return finish(partials, g)


def skinny_gemm_lh12_reference(x: jax.Array, p: Packed12) -> jax.Array:
    """What `skinny_gemm_lh12` computes, in plain JAX: decode to bf16, then a float32-accumulated dot."""
    w = jax.lax.bitcast_convert_type(decode_jax(p), jnp.bfloat16)
    return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def unprepare_lh12(lw: Lh12GemmWeight) -> Packed12:
    """The planes back without the kernel's padding: W's, or W[:, to_stored_order]'s when
    `lw.natural` (`dense_lh12` undoes that)."""
    g = Geometry.of(lw.shape, lw.config)
    segs = lw.segments_per_row
    nflag = -(-g.k * segs // LAYOUT.flag_bits)
    n_escape = lw.n_escape if lw.n_escape >= 0 else (lw.ov.shape[0] - SEG_WORDS) // SEG_WORDS
    lo = jnp.concatenate([lw.lo[:g.k, :g.m], lw.lo[:g.k, g.mp:g.mp + g.m]], axis=1)
    return Packed12(lo=lo, code=lw.code[:g.k, :g.m], flag=lw.flag[:nflag], ovbase=lw.ovbase[:nflag],
                    ov=lw.ov[:n_escape * SEG_WORDS].reshape(n_escape, SEG_WORDS),
                    shape=lw.shape, base=lw.base)


def dense_lh12(lw: Lh12GemmWeight) -> jax.Array:
    """The decoded bf16 matrix [K, N] (materialized: only for paths that are not weight-bound)."""
    bits = decode_jax(unprepare_lh12(lw))
    return jax.lax.bitcast_convert_type(from_stored_order(bits) if lw.natural else bits, jnp.bfloat16)
