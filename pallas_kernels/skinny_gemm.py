"""Skinny GEMM over bf16 weights: y[T, N] = x[T, K] @ W[K, N] for T = 1..64 (decode and verify).

One program owns `block_n` contiguous output columns (one wide tile: 128+ bytes per weight row,
so loads stay coalesced) and a 1/split_k share of K. The reduction order, per output column: rows
in chunks of 16 (a tensor-core dot of [16, block_k] x [block_k, columns] per K step, so row t's
result never depends on T: AR steps and verify steps agree bit for bit), K steps accumulated in
order, then the split_k partials added in order. A column's result does not depend on how many
columns share its dot, so the 12-bit kernel (skinny_gemm_lh12.py), which decodes 8 column stripes
of block_n // 8 columns each, runs the same arithmetic per column and gives bitwise equal outputs
on the same weights. `block_k` and `split_k` therefore are numerics, not just speed; `block_n`,
`num_warps` and `num_stages` are speed only, so a config may carry other speed settings for wide
steps (`GemmConfig.wide`, used for T > 16 rows: 4 row chunks of accumulators want other warps and
tiles than 1), under the same numerics and the same weight layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

STRIPES = 8  # column stripes: LH12 super-words hold 8 weights (specjax/weights/lh12.py)
ROW_CHUNK = 16  # rows per tensor-core dot; M = 16 keeps Triton on mma.sync for every T
WIDE_ROWS = 16  # steps of more rows run GemmConfig.wide where a config has one
# Rows one program carries (4 chunks, an accumulator each). A step of more rows (a batch-32
# verify step has 160-352) splits them over a third grid axis instead of unrolling 10-22
# accumulators into one program, whose registers would spill; each row still sees the same
# K order, so its bits do not change, and steps of up to 64 rows (AR, the 8B T <= 64 steps)
# keep their two-axis grid.
ROWS_PER_PROGRAM = 64


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tuning config of both skinny GEMMs (bf16 and LH12)."""

    block_n: int = 256  # output columns per program (12-bit: block_n // 8 in each of 8 stripes)
    block_k: int = 64  # rows of W per K step (numerics)
    split_k: int = 1  # programs along K, partials added in order (numerics)
    num_warps: int = 4
    num_stages: int = 3
    # LH12 only: flag/rank lookups per super-word, per segment, or per segment with the overflow
    # gather predicated off outside escape segments ("masked")
    escape_lookup: str = "superword"
    decode: str = "swar"  # LH12 only: byte interleave in 32-bit masks ("swar") or PTX prmt ("prmt")
    # LH12 only: join the 8 decoded stripe tiles into one [block_k, block_n] tile (columns in
    # super-word order) and run one dot per row chunk instead of 8 narrow ones
    one_dot: bool = False
    # speed settings for steps of more than WIDE_ROWS rows (same numerics; `check_layout` keeps
    # the weight's layout): None runs this config at every T
    wide: "GemmConfig | None" = None

    def __post_init__(self):
        bm = self.block_n // STRIPES
        if self.block_n % (STRIPES * 16) or bm & (bm - 1):
            raise ValueError(f"block_n must be 8 x a power of two >= 16, got {self.block_n}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.escape_lookup not in ("superword", "segment", "masked"):
            raise ValueError(f"escape_lookup must be superword, segment or masked, "
                             f"got {self.escape_lookup!r}")
        if self.decode not in ("swar", "prmt"):
            raise ValueError(f"decode must be swar or prmt, got {self.decode!r}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1: {self}")
        if self.wide is not None:
            if isinstance(self.wide, dict):  # from a JSON cache
                object.__setattr__(self, "wide", GemmConfig(**self.wide))
            if self.wide.wide is not None:
                raise ValueError("a wide config has no wide config of its own")
            if self.wide.numerics != self.numerics:
                raise ValueError(f"wide config numerics {self.wide.numerics} differ from {self.numerics}: "
                                 "AR and verify steps would round differently")

    def for_rows(self, t: int) -> "GemmConfig":
        """The settings a step of t rows runs with."""
        return self.wide if self.wide is not None and t > WIDE_ROWS else self

    @property
    def block_m(self) -> int:
        """Columns per stripe per program (super-words, in LH12 terms)."""
        return self.block_n // STRIPES

    @property
    def numerics(self) -> tuple[int, int]:
        """What fixes the reduction order: configs that share it give bitwise equal outputs."""
        return (self.block_k, self.split_k)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Padded sizes of one weight under one config."""

    k: int
    n: int
    m: int  # columns per stripe, ceil(n / 8)
    mp: int  # m rounded up to block_m
    kp: int  # k rounded up to block_k * split_k
    steps: int  # K steps per program
    npad: int  # n rounded up to block_n (the bf16 kernel's plain columns)

    @staticmethod
    def of(shape: tuple[int, int], cfg: GemmConfig) -> "Geometry":
        k, n = shape
        m = -(-n // STRIPES)
        mp = -(-m // cfg.block_m) * cfg.block_m
        per = cfg.block_k * cfg.split_k
        kp = -(-k // per) * per
        return Geometry(k, n, m, mp, kp, kp // per, -(-n // cfg.block_n) * cfg.block_n)


TARGET_PROGRAMS = 264  # two waves of the H200's 132 multiprocessors


# Speed settings per format (numerics excluded), from the H200 sweeps of 2026-12-03
# (docs/results/kernels_h200.md): LH12 wins with narrow blocks, one joined dot, PTX prmt and masked
# escape gathers; bf16 winners varied by shape within ~5% of this.
DEFAULT_SPEED = {
    "bf16": dict(block_n=256, num_warps=4, num_stages=3),
    "lh12": dict(block_n=128, num_warps=4, num_stages=3, escape_lookup="masked", decode="prmt", one_dot=True),
}


def _split(steps: int, grid_n: int, min_steps: int) -> int:
    """The largest split_k <= 16 that divides the K steps, leaves >= min_steps a program and
    brings grid_n * split_k up to about TARGET_PROGRAMS."""
    split = max(1, min(16, -(-TARGET_PROGRAMS // grid_n), steps // min_steps))
    while split > 1 and steps % split:
        split -= 1
    return split


def default_config(shape: tuple[int, int], fmt: str = "bf16", block_k: int = 64) -> GemmConfig:
    """A config from the shape alone. The numerics (block_k, split_k) do not depend on the format,
    so bf16 and 12-bit weights of one shape agree bit for bit: split K until about TARGET_PROGRAMS
    programs run at 256 columns per program, keeping >= 4 K steps per program and a split that
    divides K (no padded copy of a large weight). Speed settings: DEFAULT_SPEED[fmt].

    Small matrices (fewer than TARGET_PROGRAMS / 2 programs that way: SmolLM2's 576-1536-wide
    ones give 3-18) would leave most multiprocessors idle and each program streaming its slab at
    one multiprocessor's share of the bandwidth; there the columns go 128 a program and K splits
    down to one step a program (qkv 576x960: 72 programs instead of 4). The 8B shapes keep their
    configs (all >= 192 programs)."""
    if fmt not in DEFAULT_SPEED:
        raise ValueError(f"unknown weight format {fmt!r} (one of {tuple(DEFAULT_SPEED)})")
    k, n = shape
    m = -(-n // STRIPES)
    grid_n = -(-m // (256 // STRIPES))
    steps = max(1, -(-k // block_k))
    split = _split(steps, grid_n, 4)
    speed = dict(DEFAULT_SPEED[fmt])
    if grid_n * split < TARGET_PROGRAMS // 2:
        speed["block_n"] = 128
        split = _split(steps, -(-m // (128 // STRIPES)), 1)
    return GemmConfig(block_k=block_k, split_k=split, **speed)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)
class GemmWeight:
    """A bf16 weight [K, N] padded for `skinny_gemm` to [Kp, Np] (the plain matrix itself when
    block_k * split_k divides K and block_n divides N, as in large models)."""

    w: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    config: GemmConfig = dataclasses.field(metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))


def check_layout(shape: tuple[int, int], config: GemmConfig, fmt: str = "bf16") -> None:
    """Refuse a wide config that would need another weight layout than its base: bf16 pads N to
    block_n (equal padded sizes suffice); LH12 also counts escapes per [block_k, block_m] tile and
    packs columns by `one_dot`, so both must match."""
    w = config.wide
    if w is None:
        return
    gw, gb = Geometry.of(shape, w), Geometry.of(shape, config)
    if fmt == "lh12":
        same = gw == gb and (w.block_n, w.one_dot) == (config.block_n, config.one_dot)
    else:
        same = (gw.kp, gw.npad) == (gb.kp, gb.npad)
    if not same:
        raise ValueError(f"wide config {w} needs another {fmt} layout of {list(shape)} than {config}")


def prepare_bf16(w: jax.Array, config: GemmConfig, interpret: bool = False) -> GemmWeight:
    """[K, N] weight -> GemmWeight (a copy only where padding is needed)."""
    check_layout(tuple(w.shape), config)
    g = Geometry.of(tuple(w.shape), config)
    w = jnp.asarray(w, jnp.bfloat16)
    if (g.kp, g.npad) != (g.k, g.n):
        w = jnp.pad(w, ((0, g.kp - g.k), (0, g.npad - g.n)))
    return GemmWeight(w=w, shape=(g.k, g.n), config=config, interpret=interpret)


def unprepare_bf16(gw: GemmWeight) -> jax.Array:
    """The plain [K, N] matrix back (for paths that use XLA, e.g. prefill)."""
    k, n = gw.shape
    return gw.w if tuple(gw.w.shape) == (k, n) else gw.w[:k, :n]


def as_operand(x: jax.Array, g: Geometry) -> jax.Array:
    """x [T, K] -> bf16 [T, Kp]. Rows are not padded, so a decode step runs no pad kernel before
    each GEMM: the last row chunk reads its missing rows as copies of row T - 1 (`_chunk_index`)
    and writes their (equal) results back to row T - 1. Columns are padded only when Kp > K."""
    x = x.astype(jnp.bfloat16)
    return x if g.kp == g.k else jnp.pad(x, ((0, 0), (0, g.kp - g.k)))


def row_chunks(t: int) -> int:
    """Row chunks per program."""
    return -(-min(t, ROWS_PER_PROGRAM) // ROW_CHUNK)


def row_grid(t: int) -> tuple[int, ...]:
    """The row-block grid axis (axis 2) of a step of t rows: none up to ROWS_PER_PROGRAM."""
    return (-(-t // ROWS_PER_PROGRAM),) if t > ROWS_PER_PROGRAM else ()


def row_base(t: int):
    """First row of this program's row block (read outside loops: interpret mode lowers
    program_id only at the kernel's top level)."""
    return pl.program_id(2) * ROWS_PER_PROGRAM if t > ROWS_PER_PROGRAM else 0


def _chunk_index(c: int, t: int, col, width: int, r0=0):
    """Row and column indexers of chunk c's [16, width] block of x at column `col`: plain slices
    when all 16 rows exist, else index arrays whose rows past T - 1 repeat row T - 1. A tensor-core
    dot computes each row from its own x row alone, so the repeats only produce copies of row
    T - 1's result, which `_store` writes back to row T - 1 (the same bits): rows < T come out as
    with zero padding, bit for bit. Past ROWS_PER_PROGRAM rows, chunk c of the row block at r0
    (`row_base`) starts at r0 + 16 c, or at T - 16 where that would run past T: the last block's
    chunks slide back and recompute some rows, storing the same bits again."""
    if t > ROWS_PER_PROGRAM:
        start = jnp.minimum(r0 + c * ROW_CHUNK, t - ROW_CHUNK)
        return pl.ds(start, ROW_CHUNK), pl.ds(col, width)
    if (c + 1) * ROW_CHUNK <= t:
        return pl.ds(c * ROW_CHUNK, ROW_CHUNK), pl.ds(col, width)
    rows = jnp.minimum(c * ROW_CHUNK + jax.lax.broadcasted_iota(jnp.int32, (ROW_CHUNK, width), 0), t - 1)
    return rows, col + jax.lax.broadcasted_iota(jnp.int32, (ROW_CHUNK, width), 1)


def sum_partials(partials: jax.Array) -> jax.Array:
    """[split_k, T, columns] float32 -> [T, columns], added in split order (both kernels)."""
    y = partials[0]
    for s in range(1, partials.shape[0]):
        y = y + partials[s]
    return y


def finish(partials: jax.Array, g: Geometry) -> jax.Array:
    """12-bit kernel: [split_k, T, 8 * Mp] float32 partials (stripe-major) -> y [T, N]."""
    y = sum_partials(partials)
    if (STRIPES * g.m, g.mp) != (g.n, g.m):
        y = y.reshape(-1, STRIPES, g.mp)[:, :, :g.m].reshape(-1, STRIPES * g.m)[:, :g.n]
    return y


def chunked_dots(xs, tiles, accs):
    """accs[i * chunks + c] += xs[c] @ tiles[i]: the one dot pattern both kernels share."""
    out = list(accs)
    for i, tile in enumerate(tiles):
        for c, xc in enumerate(xs):
            out[i * len(xs) + c] = out[i * len(xs) + c] + jnp.dot(
                xc, tile, preferred_element_type=jnp.float32)
    return tuple(out)


def _store(o_ref, c: int, t: int, col, width: int, acc, r0=0):
    """Rows [16 c, 16 c + 16) of partial s = program_id(1), columns [col, col + width). In the
    last, partial chunk rows >= t hold bitwise copies of row t - 1's result (`_chunk_index`), so
    they are stored to row t - 1 as well: the same bits to the same place, and the output holds
    only the T real rows (no padded rows written to HBM, read back and sliced off)."""
    rows, cols = _chunk_index(c, t, col, width, r0)
    o_ref[pl.program_id(1), rows, cols] = acc


def store_wide(o_ref, accs, cfg: GemmConfig, t: int):
    """Chunk accumulators [16, block_n] -> columns [j * block_n, (j + 1) * block_n) of partial s."""
    n0 = pl.multiple_of(pl.program_id(0) * cfg.block_n, cfg.block_n)
    r0 = row_base(t)
    for c in range(row_chunks(t)):
        _store(o_ref, c, t, n0, cfg.block_n, accs[c], r0)


def store_accs(o_ref, accs, g: Geometry, cfg: GemmConfig, t: int):
    j, chunks, r0 = pl.program_id(0), row_chunks(t), row_base(t)
    for i in range(STRIPES):
        col = pl.multiple_of(i * g.mp + j * cfg.block_m, cfg.block_m)
        for c in range(chunks):
            _store(o_ref, c, t, col, cfg.block_m, accs[i * chunks + c], r0)


def x_chunks(x_ref, k0, cfg: GemmConfig, t: int, r0=0):
    """The activation rows as 16-row chunks [16, block_k] (see `_chunk_index`; r0 = `row_base`)."""
    return [x_ref[_chunk_index(c, t, k0, cfg.block_k, r0)] for c in range(row_chunks(t))]


def compiler_params(cfg: GemmConfig, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _bf16_kernel(x_ref, w_ref, o_ref, *, g: Geometry, cfg: GemmConfig, t: int):
    j, s, r0 = pl.program_id(0), pl.program_id(1), row_base(t)
    n0 = pl.multiple_of(j * cfg.block_n, cfg.block_n)

    def step(i, accs):
        k0 = pl.multiple_of((s * g.steps + i) * cfg.block_k, cfg.block_k)
        tile = w_ref[pl.ds(k0, cfg.block_k), pl.ds(n0, cfg.block_n)]
        return chunked_dots(x_chunks(x_ref, k0, cfg, t, r0), [tile], accs)

    zero = jnp.zeros((ROW_CHUNK, cfg.block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, g.steps, step, (zero,) * row_chunks(t))
    store_wide(o_ref, accs, cfg, t)


@jax.jit
def skinny_gemm(x: jax.Array, gw: GemmWeight) -> jax.Array:
    """x [T, K] (any float dtype, used as bf16) @ W -> float32 [T, N]."""
    g = Geometry.of(gw.shape, gw.config)
    if x.ndim != 2 or x.shape[1] != g.k:
        raise ValueError(f"skinny_gemm: x is {list(x.shape)}, weight is {list(gw.shape)}")
    t = x.shape[0]
    cfg = gw.config.for_rows(t)
    partials = pl.pallas_call(
        functools.partial(_bf16_kernel, g=g, cfg=cfg, t=t),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, t, g.npad), jnp.float32),
        grid=(g.npad // cfg.block_n, cfg.split_k) + row_grid(t),
        compiler_params=compiler_params(cfg, gw.interpret),
        interpret=gw.interpret,
        name="skinny_gemm_bf16",
    )(as_operand(x, g), gw.w)
    y = sum_partials(partials)
    return y if g.npad == g.n else y[:, :g.n]


def skinny_gemm_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """What `skinny_gemm` computes, in plain JAX: bf16 operands, float32 accumulation."""
    return jnp.dot(x.astype(jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), preferred_element_type=jnp.float32)


def bytes_read(shape: tuple[int, int]) -> int:
    """bf16 bytes of a [K, N] weight: the floor's numerator for both kernels (bf16-equivalent)."""
    return int(np.prod(shape)) * 2
