"""The hybrid target's Pallas kernels under a tensor-parallel mesh: attention split by KV heads
(as `tp_attention.py`), the tree GDN kernel by value heads.

XLA's partitioner would run each `pallas_call` whole on every device. Both kernels are
independent per head: attention per KV head and its query heads, the GDN recurrence per value
head (state [B, Hv, dk, dv], q/k/v/g/beta per head; the key heads were repeated per value head
before the kernel). So with the heads split n ways each device runs the kernel on its own heads
in `shard_map`, and each head's arithmetic is the one-device kernel's: the result is bitwise the
unsharded one. Where n does not divide the heads the kernel runs whole (replicated).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.decode_attention import decode_attention
from specjax.sharding.tp import TP_AXIS
from specjax.sharding.tp_attention import head_parallel, splits_heads


def attention_kernel(q, k_cache, v_cache, mask, end, interpret: bool, mesh=None):
    """`decode_attention` (q [B, T, Hq, hd], caches [B, S, Hkv, hd]) -> [B, T, Hq * hd], split
    by KV heads over `mesh` where they divide."""
    def kernel(q, k, v, mask, end):
        return decode_attention(q, k, v, mask, end, interpret=interpret)
    if splits_heads(mesh, k_cache.shape[2]):
        return head_parallel(kernel, mesh, q, k_cache, v_cache, mask, end)
    return kernel(q, k_cache, v_cache, mask, end)


def paged_attention_kernel(q, k_pool, v_pool, pages, mask, end, interpret: bool, mesh=None):
    """`paged_attention_masked` (q [B, T, Hq, hd], pools [num_pages, page_size, Hkv, hd], block
    table pages [B, P]) -> [B, T, Hq * hd], split by KV heads over `mesh` where they divide (the
    pools' head axis is axis 2 too)."""
    from pallas_kernels.paged_attention import paged_attention_masked

    def kernel(q, k, v, pages, mask, end):
        return paged_attention_masked(q, k, v, pages, mask, end, interpret=interpret)
    if splits_heads(mesh, k_pool.shape[2]):
        return head_parallel(kernel, mesh, q, k_pool, v_pool, pages, mask, end)
    return kernel(q, k_pool, v_pool, pages, mask, end)


def tree_gdn_kernel(state, q, k, v, g, beta, ancestors, depth: int, interpret: bool, mesh=None):
    """`tree_gdn` (state [B, Hv, dk, dv], q/k/v [B, N, Hv, d], g/beta [B, N, Hv]) -> [B, N, Hv, dv]
    float32, split by value heads over `mesh` where they divide."""
    from pallas_kernels.tree_gdn import tree_gdn

    def kernel(state, q, k, v, g, beta, ancestors):
        return tree_gdn(state, q, k, v, g, beta, ancestors, depth, interpret=interpret)
    if not splits_heads(mesh, state.shape[1]):
        return kernel(state, q, k, v, g, beta, ancestors)
    head = P(None, None, TP_AXIS)  # the head axis of [B, N, H, ...]
    specs = (P(None, TP_AXIS), head, head, head, head, head, P())
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=head, check_vma=False)(
        state, q, k, v, g, beta, ancestors)
