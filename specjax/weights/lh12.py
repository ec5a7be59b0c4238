"""LH12: a lossless 12-bit format for bf16 matrices, "low byte verbatim, high byte coded".

A bf16 pattern is a high byte H = sign | exp>>1 and a low byte L = exp&1 | mantissa. L is stored
verbatim (it is incompressible). H carries ~2.7 bits of entropy, so it is stored as a 4-bit code:
the sign and a 3-bit offset of exp>>1 in a per-tensor window [base, base+7] (16 exponents).
A 64-weight segment with any weight outside the window is an escape segment: its codes hold the
low nibble of H and an overflow plane the high nibble, so every pattern (±0, denormals, ±Inf, NaN
payloads) round-trips exactly. See docs/design/w12.md for the layout and the kernel-side costs.

Super-word m of a row holds the 8 columns m, m + M, ..., m + 7M (M = ceil(C / 8) super-words per
row): element i of every super-word belongs to stripe i, a contiguous run of M output columns. A
GPU kernel that decodes a tile of super-words into its 8 elements therefore gets 8 contiguous
column blocks, the same blocks a bf16 kernel reads from the plain matrix, so both kernels can run
the same dots in the same order (pallas_kernels/skinny_gemm*.py).

`decode` is the plain numpy inverse; `decode_jax` decodes with the 32-bit SWAR operations a GPU
kernel does in registers, so it is the reference for those kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

WORD = np.dtype("<u4")  # every plane is little-endian 32-bit words, as a kernel loads them


@dataclasses.dataclass(frozen=True)
class Layout:
    """Granularity of the planes, shared by the encoder, the decoders and the later GPU kernels.

    Planes run along the last axis, i.e. along `out` of a `[in, out]` weight, in stored order:
    stored position 8m + i is column i * M + m (see the module doc). A kernel tile of BK rows and
    BM super-words is a plain rectangular block of `code` and of each half of `lo`; with BM and
    its offset multiples of 8 it holds whole segments.
    """

    group: int = 8  # weights per super-word: two `lo` words + one `code` word = 96 bits
    segment: int = 64  # weights per escape segment, aligned along a row
    flag_bits: int = 32  # segments per FLAG / OVBASE word
    window: int = 8  # values of exp>>1 that the 3-bit offset reaches
    max_escape_fraction: float = 0.10  # above this a tensor stays bf16 (see choose_format)

    @property
    def max_base(self) -> int:
        """Largest window base: base + 7 must stay a 7-bit exp>>1 so the SWAR add cannot carry."""
        return 127 - (self.window - 1)


LAYOUT = Layout()
PLANES = ("lo", "code", "flag", "ovbase", "ov")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)  # planes are arrays: compare them with numpy, not ==
class Packed12:
    """One LH12 tensor. R, C = shape; Cp = C rounded up to 8; S = ceil(C / 64) segments per row;
    segment g = r * S + s is numbered row-major over the whole tensor."""

    lo: np.ndarray  # [R, 2M] words: word m = L of elements 0-3 of super-word m, word M+m of 4-7
    code: np.ndarray  # [R, M] words: byte i of word m = c(8m+i) | c(8m+4+i) << 4
    flag: np.ndarray  # [ceil(R*S/32)] words: bit g%32 of word g//32 is set iff segment g escapes
    ovbase: np.ndarray  # [ceil(R*S/32)] words: escape segments in all earlier flag words
    ov: np.ndarray  # [n_escape, 8] words: high nibbles of H of each escape segment, code's layout
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    base: int = dataclasses.field(metadata=dict(static=True))  # window on exp>>1: [base, base+7]

    @property
    def n_escape(self) -> int:
        return int(self.ov.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, p).nbytes for p in PLANES)

    @property
    def bits_per_weight(self) -> float:
        return lh12_bits(self.shape, self.n_escape)


@dataclasses.dataclass(frozen=True)
class FormatChoice:
    format: str  # "lh12" or "bf16"
    bits_per_weight: float  # of the chosen format
    escape_fraction: float  # of the segments (0 where LH12 does not apply)
    num_weights: int
    reason: str


def _dims(shape: tuple[int, int]) -> tuple[int, int, int]:
    """(Cp, S, flag words) for a shape."""
    rows, cols = shape
    segs = -(-cols // LAYOUT.segment)
    return -(-cols // LAYOUT.group) * LAYOUT.group, segs, -(-rows * segs // LAYOUT.flag_bits)


def plane_shapes(shape: tuple[int, int], n_escape: int) -> dict[str, tuple[int, ...]]:
    """The shape of every plane (all of dtype WORD) of a tensor: what a reader checks before use."""
    cp, _, nflag = _dims(shape)
    return {"lo": (shape[0], cp // 4), "code": (shape[0], cp // 8), "flag": (nflag,),
            "ovbase": (nflag,), "ov": (n_escape, LAYOUT.segment // 8)}


def lh12_bits(shape: tuple[int, int], n_escape: int) -> float:
    """Bits per weight of all planes: 12 per (padded) weight, 1/32 of metadata, 4 per escaped one."""
    words = sum(int(np.prod(s)) for s in plane_shapes(shape, n_escape).values())
    return 32.0 * words / max(shape[0] * shape[1], 1)


def _check_bits(w: np.ndarray) -> None:
    if not isinstance(w, np.ndarray) or w.dtype != np.uint16 or w.ndim != 2:
        raise ValueError(f"expected a 2-D uint16 array of bf16 bit patterns, got "
                         f"{getattr(w, 'dtype', type(w))} of shape {getattr(w, 'shape', '?')}")


def _stripe(x, cols: int, fill: int):
    """[R, C] in column order -> [R, Cp] in stored order (numpy or jax): pad to Cp with `fill`,
    then stored position 8m + i takes column i * M + m."""
    xp = np if isinstance(x, np.ndarray) else jnp
    rows = x.shape[0]
    cp = _dims((rows, cols))[0]
    x = xp.pad(x, ((0, 0), (0, cp - cols)), constant_values=fill)
    return x.reshape(rows, LAYOUT.group, cp // LAYOUT.group).transpose(0, 2, 1).reshape(rows, cp)


def _unstripe(x, cols: int):
    """Inverse of `_stripe`: [R, Cp] in stored order -> [R, C] in column order."""
    rows, cp = x.shape
    return x.reshape(rows, cp // LAYOUT.group, LAYOUT.group).transpose(0, 2, 1).reshape(rows, cp)[:, :cols]


def _segment_ranges(w, xp=np):
    """(min, max) of exp>>1 per segment in stored order, [R, S] each. Padding takes no part: it is
    written later with the chosen base, which lies in every window that base opens."""
    rows, cols = w.shape
    _, segs, _ = _dims(w.shape)
    e2 = ((w >> 8) & 0x7F).astype(xp.int16)
    pad = ((0, 0), (0, segs * LAYOUT.segment - _dims(w.shape)[0]))
    lo = xp.pad(_stripe(e2, cols, 127), pad, constant_values=127)
    hi = xp.pad(_stripe(e2, cols, 0), pad, constant_values=0)
    lo = lo.reshape(rows, segs, LAYOUT.segment).min(axis=-1, initial=127)
    hi = hi.reshape(rows, segs, LAYOUT.segment).max(axis=-1, initial=0)
    return lo, hi


def _plan(w: np.ndarray) -> tuple[int, np.ndarray]:
    """The window base that leaves the fewest escape segments, and the [R, S] escape mask.

    Escapes cost per segment, not per weight, so the base is chosen on segment counts: a segment
    whose exp>>1 spans [lo, hi] is covered by every base in [hi - 7, lo].
    """
    lo, hi = _segment_ranges(w)
    first = np.maximum(hi - (LAYOUT.window - 1), 0)
    last = np.minimum(lo, LAYOUT.max_base)
    fits = first <= last
    n = LAYOUT.max_base + 2
    covered = np.cumsum(np.bincount(first[fits], minlength=n) - np.bincount(last[fits] + 1, minlength=n))
    base = int(np.argmax(covered[:-1]))
    return base, ~((lo >= base) & (hi <= base + LAYOUT.window - 1))


def _pack_nibbles(c: np.ndarray) -> np.ndarray:
    """[..., 8m] nibbles -> [..., m] words, byte i of word m = c(8m+i) | c(8m+4+i) << 4."""
    c = c.reshape(*c.shape[:-1], c.shape[-1] // 8, 2, 4)
    packed = np.ascontiguousarray(c[..., 0, :] | (c[..., 1, :] << 4))
    return packed.view(WORD).reshape(c.shape[:-2])


def _unpack_nibbles(words: np.ndarray, n: int) -> np.ndarray:
    """Inverse of `_pack_nibbles`: [..., n/8] words -> [..., n] nibbles (uint8)."""
    b = np.ascontiguousarray(words, WORD).view(np.uint8).reshape(*words.shape, 1, 4)
    return np.concatenate([b & 0xF, b >> 4], axis=-2).reshape(*words.shape[:-1], n)


def choose_format(w: np.ndarray) -> FormatChoice:
    """LH12 or bf16 for one tensor of bf16 bit patterns (uint16), with the reason.

    Escapes cost bytes (4 bits per escaped weight) and, in the kernel, a lane-divergent dependent
    load of the overflow nibbles. Past `max_escape_fraction` of escape segments that path costs
    more time than the 25% of bytes saved, so the tensor stays bf16 (research note §5.2).
    """
    if not isinstance(w, np.ndarray) or w.dtype != np.uint16:
        raise ValueError(f"expected a uint16 array of bf16 bit patterns, got {getattr(w, 'dtype', type(w))}")
    if w.ndim != 2 or w.size == 0:
        return FormatChoice("bf16", 16.0, 0.0, int(w.size), f"not a non-empty matrix (shape {w.shape})")
    base, escaped = _plan(w)
    frac = float(escaped.mean())
    bits = lh12_bits(w.shape, int(escaped.sum()))
    limit = LAYOUT.max_escape_fraction
    if frac > limit or bits >= 16.0:
        return FormatChoice("bf16", 16.0, frac, int(w.size),
                            f"{frac:.1%} of {LAYOUT.segment}-weight segments escape the best exponent "
                            f"window (limit {limit:.0%}); LH12 would take {bits:.2f} bits/weight")
    return FormatChoice("lh12", bits, frac, int(w.size),
                        f"{frac:.2%} of segments escape exponents [{2 * base}, {2 * base + 15}]")


def encode(w: np.ndarray) -> Packed12:
    """bf16 bit patterns [R, C] (uint16) -> LH12 planes, exact for every pattern."""
    _check_bits(w)
    rows, cols = w.shape
    base, escaped = _plan(w)
    cp, segs, nflag = _dims(w.shape)
    # Stored order; padding (to Cp, then to whole segments) is the pattern whose code is 0.
    u = np.pad(_stripe(w, cols, base << 8), ((0, 0), (0, segs * LAYOUT.segment - cp)),
               constant_values=base << 8)
    h = (u >> 8).reshape(rows, segs, LAYOUT.segment)
    normal = ((h >> 7) << 3) | ((h & 0x7F) - base)  # sign | offset (wraps only where unused)
    codes = np.where(escaped[..., None], h & 0xF, normal).astype(np.uint8)
    codes = codes.reshape(rows, segs * LAYOUT.segment)
    low = (u[:, :cp] & 0xFF).astype(np.uint8).reshape(rows, cp // LAYOUT.group, 2, 4)
    lo = np.ascontiguousarray(low.transpose(0, 2, 1, 3)).view(WORD).reshape(rows, cp // 4)
    ov = _pack_nibbles((h.reshape(rows * segs, LAYOUT.segment)[escaped.ravel()] >> 4).astype(np.uint8))
    bits = np.zeros(nflag * LAYOUT.flag_bits, bool)
    bits[:rows * segs] = escaped.ravel()
    flag = np.packbits(bits, bitorder="little").view(WORD)
    counts = bits.reshape(nflag, LAYOUT.flag_bits).sum(axis=1)
    ovbase = (np.cumsum(counts) - counts).astype(WORD)
    return Packed12(lo=lo, code=_pack_nibbles(codes[:, :cp]), flag=flag, ovbase=ovbase,
                    ov=ov, shape=(rows, cols), base=base)


def decode(p: Packed12) -> np.ndarray:
    """LH12 planes -> the original bf16 bit patterns [R, C] (uint16), in numpy."""
    rows, cols = p.shape
    cp, segs, _ = _dims(p.shape)
    for name, shape in plane_shapes(p.shape, p.n_escape).items():
        plane = getattr(p, name)
        if plane.dtype != WORD or plane.shape != shape:
            raise ValueError(f"plane {name} is {plane.dtype}{list(plane.shape)}, "
                             f"expected uint32{list(shape)}")
    escaped = np.unpackbits(p.flag.view(np.uint8), bitorder="little")[:rows * segs].astype(bool)
    if escaped.sum() != p.n_escape:
        raise ValueError(f"{escaped.sum()} segments are flagged but {p.n_escape} are stored")
    c = _unpack_nibbles(p.code, cp).astype(np.uint16)
    h = ((c & 8) << 4) | (p.base + (c & 7))
    if p.n_escape:
        ovn = np.zeros((rows * segs, LAYOUT.segment), np.uint16)
        ovn[escaped] = _unpack_nibbles(p.ov, LAYOUT.segment)
        esc = np.repeat(escaped.reshape(rows, segs), LAYOUT.segment, axis=1)[:, :cp]
        h = np.where(esc, (ovn.reshape(rows, segs * LAYOUT.segment)[:, :cp] << 4) | c, h)
    lo = np.ascontiguousarray(p.lo).view(np.uint8).reshape(rows, 2, cp // LAYOUT.group, 4)
    lo = lo.transpose(0, 2, 1, 3).reshape(rows, cp)
    return _unstripe((h << 8) | lo, cols)


def decode_jax(p: Packed12) -> jax.Array:
    """LH12 planes -> bf16 bit patterns [R, C] (uint16), with the kernel's word-level operations.

    Per super-word m: one code word and two lo words become four bf16x2 words. Escapes are found
    as a kernel does: flag bit, rank = ovbase + popcount of the lower flag bits, then the overflow
    word at rank * 8 + m % 8. Jittable (shape and base are static).
    """
    return _unstripe(decode_stored_jax(p), p.shape[1])


def decode_stored_jax(p: Packed12) -> jax.Array:
    """`decode_jax` before the stripe permutation: [R, Cp] uint16 in stored order."""
    rows, cols = p.shape
    cp, segs, _ = _dims(p.shape)
    per_seg = LAYOUT.segment // LAYOUT.group
    u32 = jnp.uint32
    pc = jnp.asarray(p.code, u32)  # [R, M]
    lo = jnp.asarray(p.lo, u32).reshape(rows, 2, cp // LAYOUT.group).transpose(0, 2, 1)  # [R, M, 2]
    m = jnp.arange(cp // LAYOUT.group, dtype=u32)
    g = jnp.arange(rows, dtype=u32)[:, None] * segs + m // per_seg  # segment of each super-word
    word = jnp.asarray(p.flag, u32)[g // LAYOUT.flag_bits]
    bit = g % LAYOUT.flag_bits
    esc = ((word >> bit) & 1) == 1
    below = jax.lax.population_count(word & ((u32(1) << bit) - 1))  # escaped segments before g
    rank = jnp.asarray(p.ovbase, u32)[g // LAYOUT.flag_bits] + below
    ov = jnp.concatenate([jnp.asarray(p.ov, u32).reshape(-1), jnp.zeros(1, u32)])  # [-1]: not escaped
    ovw = ov[jnp.where(esc, rank * per_seg + m % per_seg, p.n_escape * per_seg)]

    b4 = u32(p.base * 0x01010101)
    nib, off, sign, high_nib = u32(0x0F0F0F0F), u32(0x07070707), u32(0x80808080), u32(0xF0F0F0F0)
    even, odd = u32(0x00FF00FF), u32(0xFF00FF00)
    xa, xb = pc & nib, (pc >> 4) & nib  # codes of elements 0-3 and 4-7, one per byte
    ha = jnp.where(esc, xa | ((ovw << 4) & high_nib), ((xa & off) + b4) | ((xa << 4) & sign))
    hb = jnp.where(esc, xb | (ovw & high_nib), ((xb & off) + b4) | ((xb << 4) & sign))
    halves = []
    for low, high in ((lo[..., 0], ha), (lo[..., 1], hb)):
        w02 = (low & even) | ((high << 8) & odd)  # bf16x2 of elements 0 and 2
        w13 = ((low >> 8) & even) | (high & odd)  # elements 1 and 3
        halves.append(jnp.stack([w02 & 0xFFFF, w13 & 0xFFFF, w02 >> 16, w13 >> 16], axis=-1))
    return jnp.concatenate(halves, axis=-1).reshape(rows, cp).astype(jnp.uint16)


# ----------------------------------------------------------------------------- device encoder

@jax.jit
def _plan_jax(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_plan` in jnp: (base, [R, S] escape mask), on whatever device holds `w`."""
    lo, hi = _segment_ranges(w, jnp)
    first = jnp.maximum(hi - (LAYOUT.window - 1), 0)
    last = jnp.minimum(lo, LAYOUT.max_base)
    fits = (first <= last).ravel()
    n = LAYOUT.max_base + 2
    add = jnp.zeros(n, jnp.int32).at[first.ravel()].add(fits)
    drop = jnp.zeros(n, jnp.int32).at[jnp.minimum(last.ravel() + 1, n - 1)].add(fits)
    base = jnp.argmax(jnp.cumsum(add - drop)[:-1])
    return base, ~((lo >= base) & (hi <= base + LAYOUT.window - 1))


def _pack_nibbles_jax(c: jax.Array) -> jax.Array:
    c = c.astype(jnp.uint32).reshape(*c.shape[:-1], c.shape[-1] // 8, 2, 4)
    b = c[..., 0, :] | (c[..., 1, :] << 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bytes_to_words(b: jax.Array) -> jax.Array:
    b = b.astype(jnp.uint32).reshape(*b.shape[:-1], b.shape[-1] // 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


@functools.partial(jax.jit, static_argnames=("ov_rows",))
def _encode_planes_jax(w, escaped, base, ov_rows: int):
    """The planes, with `ov` in ov_rows rows (a power of two >= the escape count): the base is data
    and the escape count is bucketed so that every tensor of a shape shares one compiled program
    (a model's 120 tensors took 199 s to pack on an H100, 2026-12-08, when each compiled its own)."""
    rows, cols = w.shape
    cp, segs, nflag = _dims(w.shape)
    base = jnp.asarray(base, jnp.uint32)
    fill = (base << 8).astype(jnp.uint16)
    u = jnp.pad(_stripe(w, cols, fill), ((0, 0), (0, segs * LAYOUT.segment - cp)),
                constant_values=fill).astype(jnp.uint32)
    h = (u >> 8).reshape(rows, segs, LAYOUT.segment)
    normal = ((h >> 7) << 3) | ((h & 0x7F) - base)
    codes = jnp.where(escaped[..., None], h & 0xF, normal & 0xF).reshape(rows, segs * LAYOUT.segment)
    low = (u[:, :cp] & 0xFF).reshape(rows, cp // LAYOUT.group, 2, 4).transpose(0, 2, 1, 3)
    lo = _bytes_to_words(low.reshape(rows, cp))
    which = jnp.nonzero(escaped.ravel(), size=ov_rows)[0]
    ov = _pack_nibbles_jax(h.reshape(rows * segs, LAYOUT.segment)[which] >> 4)
    bits = jnp.zeros(nflag * LAYOUT.flag_bits, jnp.uint32).at[:rows * segs].set(escaped.ravel())
    bits = bits.reshape(nflag, LAYOUT.flag_bits)
    flag = jnp.sum(bits << jnp.arange(LAYOUT.flag_bits, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)
    counts = jnp.sum(bits, axis=1, dtype=jnp.uint32)
    return lo, _pack_nibbles_jax(codes[:, :cp]), flag, jnp.cumsum(counts) - counts, ov


def plan_base_jax(w: jax.Array) -> int:
    """The window base `encode_jax` would choose for `w` (one host sync)."""
    return int(_plan_jax(jnp.asarray(w))[0])


def encode_jax(w: jax.Array, base: int | None = None) -> Packed12:
    """`encode` on the device for large tensors (benchmarks pack 8B-shaped models with it): the
    same planes, as jax arrays. One host sync reads the escape count, which sizes `ov`. `base`
    pins the window (shards of one tensor share the whole tensor's: a kernel body is traced once
    for every device of a mesh, and the base is static in it); default: the best for `w`."""
    w = jnp.asarray(w)
    if w.dtype != jnp.uint16 or w.ndim != 2:
        raise ValueError(f"expected a 2-D uint16 array of bf16 bit patterns, got {w.dtype}{list(w.shape)}")
    if base is None:
        base, escaped = _plan_jax(w)
    else:
        if not 0 <= base <= LAYOUT.max_base:
            raise ValueError(f"window base must be in [0, {LAYOUT.max_base}], got {base}")
        lo, hi = _segment_ranges(w, jnp)
        escaped = ~((lo >= base) & (hi <= base + LAYOUT.window - 1))
    base, n_escape = int(base), int(escaped.sum())
    rows = 1 << max(n_escape - 1, 0).bit_length()
    lo, code, flag, ovbase, ov = _encode_planes_jax(w, escaped, np.uint32(base), rows)
    ov = np.asarray(ov)[:n_escape]  # a few KB; sliced on the host, so no program per escape count
    return Packed12(lo=lo, code=code, flag=flag, ovbase=ovbase, ov=ov, shape=tuple(w.shape), base=base)
