"""The bf16 skinny GEMMs under a tensor-parallel mesh (docs/design/tensor_parallel.md).

XLA's partitioner does not split a `pallas_call`: on a GPU it would run each kernel whole on
every device, after gathering its weight. So a kernel weight over a "tp" mesh is a `TPGemmWeight`
and its GEMM runs in `shard_map`: column-parallel weights (w_qkv, w_gate_up, lm_head) give each
device its [K, N / n] columns and need no communication; row-parallel ones (w_o, w_down) give
each device [K / n, N] rows and its partial products, summed by a psum. A column's arithmetic
does not depend on which columns share its program, so column-parallel GEMMs are bitwise those
of one device; row-parallel sums add n partials in another order (near-ties, as with XLA's
sharded GEMMs). Each device's shard is its own kernel weight, tiled for its shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.skinny_gemm import GemmConfig, GemmWeight, Geometry, skinny_gemm
from specjax.sharding.tp import COLUMN_PARALLEL, ROW_PARALLEL, TP_AXIS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(eq=False)
class TPGemmWeight:
    """A bf16 weight [K, N] placed over the mesh, columns or rows split (see the module doc)."""

    w: jax.Array  # the plain [K, N] bf16 matrix, sharded P(None, tp) or P(tp, None)
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    mode: str = dataclasses.field(metadata=dict(static=True))  # "column" or "row"
    config: GemmConfig = dataclasses.field(metadata=dict(static=True))  # one shard's tiles
    mesh: Mesh = dataclasses.field(metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def local_shape(self) -> tuple[int, int]:
        return local_shape(self.shape, self.mode, self.mesh.shape[TP_AXIS])

    @property
    def specs(self) -> tuple[P, P, P]:
        """(x, w, y) partition specs inside `tp_gemm`."""
        if self.mode == "column":
            return P(), P(None, TP_AXIS), P(None, TP_AXIS)
        return P(None, TP_AXIS), P(TP_AXIS, None), P()


def mode_of(name: str) -> str | None:
    return "column" if name in COLUMN_PARALLEL else "row" if name in ROW_PARALLEL else None


def local_shape(shape: tuple[int, int], mode: str, n: int) -> tuple[int, int]:
    """One device's block of a [K, N] matrix split n ways by columns or rows."""
    k, m = shape
    return (k, m // n) if mode == "column" else (k // n, m)


def split_of(name: str, w, mesh: Mesh) -> tuple[str, tuple[int, int], tuple[int, int]] | None:
    """(mode, whole shape, one device's shape) of parameter `name` over the mesh, or None where
    the rules do not split it or n does not divide it."""
    mode, n = mode_of(name), mesh.shape[TP_AXIS]
    k, m = (int(d) for d in w.shape)
    if mode is None or (m if mode == "column" else k) % n:
        return None
    return mode, (k, m), local_shape((k, m), mode, n)


def tp_kernel_weight(name: str, w: jax.Array, mesh: Mesh, config_for, interpret: bool = False):
    """A `TPGemmWeight` for parameter `name`, or None where the rules do not split it, n does not
    divide it, or a shard would need padding for its tiles (the caller keeps a whole-matrix kernel
    weight then: correct, but every device reads all of it)."""
    split = split_of(name, w, mesh)
    if split is None:
        return None
    mode, (k, m), local = split
    cfg = config_for(local)
    if Geometry.of(local, cfg).npad != local[1]:  # block_n is speed only: the narrowest may fit
        cfg = dataclasses.replace(cfg, block_n=128)
    g = Geometry.of(local, cfg)
    if (g.kp, g.npad) != local:
        return None
    tw = TPGemmWeight(jnp.asarray(w, jnp.bfloat16), (k, m), mode, cfg, mesh, interpret)
    return dataclasses.replace(tw, w=jax.device_put(tw.w, NamedSharding(mesh, tw.specs[1])))


def tp_gemm(x: jax.Array, tw: TPGemmWeight) -> jax.Array:
    """x [T, K] @ W -> float32 [T, N], one skinny GEMM per device."""
    x_spec, w_spec, y_spec = tw.specs

    def local(xs, ws):
        y = skinny_gemm(xs, GemmWeight(ws, tw.local_shape, tw.config, tw.interpret))
        return y if tw.mode == "column" else jax.lax.psum(y, TP_AXIS)

    return jax.shard_map(local, mesh=tw.mesh, in_specs=(x_spec, w_spec), out_specs=y_spec,
                         check_vma=False)(x.astype(jnp.bfloat16), tw.w)
