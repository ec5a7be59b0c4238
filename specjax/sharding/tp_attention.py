"""The fused attention kernels under a tensor-parallel mesh: one KV-head group per device.

XLA's partitioner runs a `pallas_call` whole on every device, so without this each device
would attend over every head. Attention is independent per KV head and its query heads (a query
head h reads KV head h // G), so with the KV heads split n ways each device runs the kernel on
its own Hkv / n KV heads and their Hq / n query heads, in `shard_map`; the output's head axis is
split the same way. Each head's arithmetic is the unsharded kernel's, so the result is bitwise
the one-device result. Where n does not divide the KV heads the kernel runs whole (replicated).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, PartitionSpec as P

from specjax.sharding.tp import TP_AXIS


def splits_heads(mesh: Mesh | None, num_kv_heads: int) -> bool:
    return mesh is not None and mesh.shape[TP_AXIS] > 1 and num_kv_heads % mesh.shape[TP_AXIS] == 0


def head_parallel(kernel, mesh: Mesh, q, k_cache, v_cache, *replicated):
    """kernel(q [B, T, Hq, hd], k, v [B, S, Hkv, hd], *replicated) -> [B, T, Hq * hd], run with
    the heads split over the mesh (`splits_heads` must hold)."""
    heads = P(None, None, TP_AXIS, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(heads, heads, heads) + (P(),) * len(replicated),
                         out_specs=P(None, None, TP_AXIS), check_vma=False)(q, k_cache, v_cache, *replicated)


def bind(fn, **static):
    """`fn` with its static keyword arguments fixed (shard_map passes arrays only)."""
    return functools.partial(fn, **static)
