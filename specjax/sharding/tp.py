"""Tensor-parallel placement of a target's weights over a 1-D mesh (docs/design/tensor_parallel.md).

The rules name parameters, not shapes: column-parallel projections split their output columns,
row-parallel ones their input rows (XLA adds the all-reduce after them), per-head vectors their
heads; the rest is replicated. GSPMD partitions the unchanged step functions from there.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.errors import ConfigError

TP_AXIS = "tp"

COLUMN_PARALLEL = ("w_qkv", "w_qgkv", "w_gate_up", "w_in", "lm_head")  # [D, out]: split out
ROW_PARALLEL = ("w_o", "w_down", "w_out")  # [in, D]: split in; an all-reduce follows
PER_CHANNEL = ("conv_w",)  # [K, channels]: split channels
PER_HEAD = ("A_log", "dt_bias")  # [heads]


def tp_mesh(n: int, devices=None) -> Mesh:
    """A mesh of the first n devices with one axis, "tp"."""
    devices = jax.devices() if devices is None else devices
    if not 1 <= n <= len(devices):
        raise ConfigError(f"tensor parallelism over {n} devices: {len(devices)} available "
                          "(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
    return Mesh(np.asarray(devices[:n]), (TP_AXIS,))


def _leaf_name(path) -> str:
    last = path[-1]
    return getattr(last, "name", None) or str(getattr(last, "key", last))


def param_spec(name: str, shape: tuple[int, ...], n: int) -> P:
    """The PartitionSpec of one parameter; a split that does not divide stays replicated."""
    axis = None
    if name in COLUMN_PARALLEL or name in PER_CHANNEL:
        axis = len(shape) - 1
    elif name in ROW_PARALLEL:
        axis = 0
    elif name in PER_HEAD:
        axis = 0
    if axis is None or len(shape) <= axis or shape[axis] % n:
        return P()
    spec = [None] * len(shape)
    spec[axis] = TP_AXIS
    return P(*spec)


@dataclasses.dataclass(frozen=True)
class ShardReport:
    sharded: tuple[str, ...]  # parameter paths split over the mesh
    replicated_uneven: tuple[str, ...]  # would be split by the rules but do not divide


def param_shardings(params, mesh: Mesh):
    """The params pytree's NamedShardings, and a report of what was split."""
    n = mesh.shape[TP_AXIS]
    sharded, uneven = [], []

    def one(path, x):
        name = _leaf_name(path)
        spec = param_spec(name, x.shape, n)
        label = jax.tree_util.keystr(path)
        if spec != P():
            sharded.append(label)
        elif name in COLUMN_PARALLEL + ROW_PARALLEL + PER_CHANNEL + PER_HEAD and n > 1:
            uneven.append(label)
        return NamedSharding(mesh, spec)
    shardings = jax.tree_util.tree_map_with_path(one, params)
    return shardings, ShardReport(tuple(sharded), tuple(uneven))


def shard_params(params, mesh: Mesh):
    """params placed over the mesh by the rules -> (params, ShardReport)."""
    shardings, report = param_shardings(params, mesh)
    return jax.device_put(params, shardings), report


def replicate(tree, mesh: Mesh):
    """Every array leaf of `tree` replicated over the mesh (a drafter's weights, by default)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
