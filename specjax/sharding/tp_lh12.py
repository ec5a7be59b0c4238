"""12-bit (LH12) kernel weights under a tensor-parallel mesh (docs/design/tensor_parallel.md).

As `tp_kernels.py` does for bf16, each device holds one shard of the matrix, columns
(w_qkv, w_gate_up, lm_head) or rows (w_o, w_down), and runs its own skinny GEMM in `shard_map`.
Here each shard is packed on its own: its planes are those `encode_jax` gives for the [K, N / n]
or [K / n, N] block, stacked along a leading device axis that the mesh splits. The shards share
one exponent window base, the whole tensor's (the static `base` that unpacking keeps is one per
weight); a shard's escapes follow from its own segments under that base, so each shard still
round-trips exactly. The escape overflow words, whose
count differs per shard, are zero-padded to the longest; the padding lies past every rank, and
the kernel's all-zero sentinel stays the last 8 words.

Column-parallel 12-bit GEMMs are bitwise the bf16 ones of `tp_kernels.py` (same local numerics,
exact weights), hence bitwise one device's; row-parallel sums add the n partials with a psum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.skinny_gemm import GemmConfig, Geometry
from pallas_kernels.skinny_gemm_lh12 import (Lh12GemmWeight, dense_lh12, natural_order, prepare_lh12,
                                             skinny_gemm_lh12, to_stored_order)
from specjax.sharding.tp import TP_AXIS
from specjax.sharding.tp_kernels import local_shape, split_of
from specjax.weights.lh12 import LAYOUT, encode_jax, plan_base_jax

PLANES = ("code", "lo", "flag", "ovbase", "ov", "tile_escapes", "base_word")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)
class TPLh12Weight:
    """Per-device LH12 planes of one weight, each [n, ...] and split along the device axis."""

    code: jax.Array
    lo: jax.Array
    flag: jax.Array
    ovbase: jax.Array
    ov: jax.Array
    tile_escapes: jax.Array
    base_word: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))  # the whole [K, N]
    mode: str = dataclasses.field(metadata=dict(static=True))  # "column" or "row"
    base: int = dataclasses.field(metadata=dict(static=True))
    config: GemmConfig = dataclasses.field(metadata=dict(static=True))  # one shard's tiles
    natural: bool = dataclasses.field(metadata=dict(static=True))
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def local_shape(self) -> tuple[int, int]:
        return local_shape(self.shape, self.mode, self.mesh.shape[TP_AXIS])

    @property
    def nbytes(self) -> int:
        """Bytes all devices stream together (planes and escape data, padding included)."""
        return sum(int(getattr(self, f).size) * 4 for f in PLANES[:5])

    def local(self, planes: dict) -> Lh12GemmWeight:
        """The Lh12GemmWeight of one device inside `shard_map` (planes with the device axis cut)."""
        return Lh12GemmWeight(**{f: planes[f][0] for f in PLANES}, shape=self.local_shape, base=self.base,
                              config=self.config, interpret=self.interpret, natural=self.natural)

    def planes(self) -> dict:
        return {f: getattr(self, f) for f in PLANES}


def _shards(bits: jax.Array, mode: str, n: int) -> list[jax.Array]:
    return jnp.split(bits, n, axis=1 if mode == "column" else 0)


def _stack(arrays: list[jax.Array]) -> jax.Array:
    """Per-shard 1-D or 2-D arrays -> [n, ...], zero-padded along axis 0 to the longest."""
    size = max(a.shape[0] for a in arrays)
    return jnp.stack([jnp.pad(a, [(0, size - a.shape[0])] + [(0, 0)] * (a.ndim - 1)) for a in arrays])


def tp_lh12_weight(name: str, w: jax.Array, mesh: Mesh, config_for, interpret: bool = False):
    """A `TPLh12Weight` for parameter `name` (a bf16 [K, N] matrix); None where the rules do not
    split it, n does not divide it, or a shard would need padding for its tiles (the caller then
    keeps a whole-matrix weight); a reason string where escapes exceed the format's limit (the
    caller keeps it bf16, as `kernel_params` does for one device). `config_for(local_shape)` ->
    the shard's 12-bit config."""
    split = split_of(name, w, mesh)
    if split is None:
        return None
    mode, (k, m), local = split
    n = mesh.shape[TP_AXIS]
    cfg = config_for(local)
    g = Geometry.of(local, cfg)
    if g.kp != local[0]:
        return None  # a shard's K would need padding: keep the whole matrix
    bits = jax.lax.bitcast_convert_type(jnp.asarray(w, jnp.bfloat16), jnp.uint16)
    base = plan_base_jax(bits)
    natural = natural_order(local, cfg)
    packed, escapes = [], 0
    for shard in _shards(bits, mode, n):
        p = encode_jax(to_stored_order(shard) if natural else shard, base=base)
        escapes += p.n_escape
        packed.append(prepare_lh12(p, cfg, interpret, permuted=natural))
    frac = escapes / max(k * -(-m // LAYOUT.segment), 1)
    if frac > LAYOUT.max_escape_fraction:
        return f"{frac:.1%} escape segments (limit {LAYOUT.max_escape_fraction:.0%}): kept bf16"
    # ov: padding goes after each shard's zero sentinel, so its last 8 words stay zeros
    planes = {f: _stack([getattr(p, f) for p in packed]) for f in PLANES}
    placed = {f: jax.device_put(a, NamedSharding(mesh, P(TP_AXIS))) for f, a in planes.items()}
    return TPLh12Weight(**placed, shape=(k, m), mode=mode, base=base, config=cfg, natural=natural,
                        mesh=mesh, interpret=interpret)


def tp_gemm_lh12(x: jax.Array, tw: TPLh12Weight) -> jax.Array:
    """x [T, K] @ decode(W) -> float32 [T, N], one 12-bit skinny GEMM per device."""
    x_spec, y_spec = (P(), P(None, TP_AXIS)) if tw.mode == "column" else (P(None, TP_AXIS), P())

    def local(xs, planes):
        y = skinny_gemm_lh12(xs, tw.local(planes))
        return y if tw.mode == "column" else jax.lax.psum(y, TP_AXIS)

    specs = {f: P(TP_AXIS) for f in PLANES}
    return jax.shard_map(local, mesh=tw.mesh, in_specs=(x_spec, specs), out_specs=y_spec,
                         check_vma=False)(x.astype(jnp.bfloat16), tw.planes())


def dense_tp_lh12(tw: TPLh12Weight) -> jax.Array:
    """The decoded bf16 [K, N] matrix, split over the mesh like the planes (prefill runs XLA's
    sharded GEMM over it)."""
    w_spec = P(None, TP_AXIS) if tw.mode == "column" else P(TP_AXIS, None)
    specs = {f: P(TP_AXIS) for f in PLANES}
    return jax.shard_map(lambda planes: dense_lh12(tw.local(planes)), mesh=tw.mesh, in_specs=(specs,),
                         out_specs=w_spec, check_vma=False)(tw.planes())
