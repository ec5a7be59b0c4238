"""Step-time model: per component, time = max(bytes / bandwidth, flops / rate) + fixed costs; the
ceiling puts every component at its physical floor (bytes / peak bandwidth, flops / peak rate, no
fixed costs) with the same acceptance. Pure JAX: `predict` is jit + vmap over candidate arrays.

Components: verify (one target forward over k + 1 tokens, weights + KV read once), draft (the
proposer's forwards: none for n-gram, k narrow forwards of the first K layers for layer-skip), commit
(acceptance, cache/sequence update, loop), host (prefill, dispatch and transfers outside the decode
loop, per generated token). Expected tokens per step from per-position conditional
acceptance a_i: E[N] = 1 + sum_j prod_{i<=j} a_i (bonus token included; AR = 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.costmodel.hardware import DeviceModel
from specjax.models.config import ModelConfig
from specjax.search.registry import COMPONENTS

KMAX = 32  # longest draft the acceptance profiles cover


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Bytes and flops of one forward, from the target's config."""
    layer_bytes: float  # weights of one layer
    head_bytes: float  # final norm + lm_head (tied heads still stream the embedding)
    layer_flops: float  # per token, one layer
    head_flops: float  # per token
    kv_bytes_per_slot: float  # per layer, K and V of one cache slot
    attn_flops_per_slot: float  # per token per layer per slot
    num_layers: int
    num_slots: int

    @staticmethod
    def of(cfg: ModelConfig, num_slots: int) -> "ModelDims":
        item = 4 if cfg.dtype == "float32" else 2
        D, F = cfg.hidden_size, cfg.intermediate_size
        layer_params = D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D + 3 * D * F + 2 * D
        head_params = cfg.vocab_size * D + D
        return ModelDims(layer_bytes=layer_params * item, head_bytes=head_params * item,
                         layer_flops=2.0 * layer_params, head_flops=2.0 * head_params,
                         kv_bytes_per_slot=2.0 * cfg.kv_size * item,
                         attn_flops_per_slot=4.0 * cfg.q_size, num_layers=cfg.num_layers,
                         num_slots=num_slots)


def _forward_time(dims: ModelDims, dev: DeviceModel, layers, tokens, peak: bool):
    bytes_ = layers * (dims.layer_bytes + dims.num_slots * dims.kv_bytes_per_slot) + dims.head_bytes
    flops = tokens * (layers * (dims.layer_flops + dims.num_slots * dims.attn_flops_per_slot) + dims.head_flops)
    bw = dev.peak_bandwidth if peak else dev.bandwidth
    rate = dev.peak_flops if peak else dev.flops
    fixed = 0.0 if peak else dev.step_overhead + layers * dev.layer_overhead
    return fixed + jnp.maximum(bytes_ / bw, flops / rate)


def expected_tokens(alpha, k):
    """alpha [KMAX] conditional acceptance per position, k draft length -> E[tokens per step]."""
    idx = jnp.arange(KMAX)
    survive = jnp.cumprod(jnp.where(idx < k, alpha, 0.0))
    return 1.0 + jnp.sum(survive)


def _one(dims: ModelDims, dev: DeviceModel, k, kind, layers, alpha):
    """Component times, floors and rates for one candidate (kind: 0 none, 1 ngram, 2 layerskip)."""
    speculative = kind > 0
    k = jnp.where(speculative, k, 0)
    verify = _forward_time(dims, dev, dims.num_layers, k + 1, peak=False)
    verify_floor = _forward_time(dims, dev, dims.num_layers, k + 1, peak=True)
    # layer-skip: one width-2 catch-up forward, then k - 1 width-1 forwards of the first K layers
    ls = jnp.where(k > 0, _forward_time(dims, dev, layers, 2, False) +
                   (k - 1) * _forward_time(dims, dev, layers, 1, False), 0.0)
    ls_floor = jnp.where(k > 0, _forward_time(dims, dev, layers, 2, True) +
                         (k - 1) * _forward_time(dims, dev, layers, 1, True), 0.0)
    draft = jnp.where(kind == 2, ls, jnp.where(kind == 1, dev.step_overhead * 0.25, 0.0))
    draft_floor = jnp.where(kind == 2, ls_floor, 0.0)
    commit = jnp.where(speculative, dev.round_overhead, dev.round_overhead * 0.5)
    tokens = jnp.where(speculative, expected_tokens(alpha, k), 1.0)
    host = tokens * dev.host_per_token  # paid per token, so per step it scales with tokens per step
    times = jnp.stack([verify, draft, commit, host])
    floors = jnp.stack([verify_floor, draft_floor, 0.0 * commit, 0.0 * host])
    return dict(tokens_per_step=tokens, step_time=times.sum(), floor_time=floors.sum(),
                tokens_per_s=tokens / times.sum(), ceiling_tokens_per_s=tokens / floors.sum(),
                component_time=times, component_floor=floors, component_gap=times - floors)


_COMPILED: dict = {}


def predict(dims: ModelDims, dev: DeviceModel, k, kind, layers, alpha) -> dict:
    """Vectorized over candidates: k, kind, layers [C]; alpha [C, KMAX] -> dict of [C] / [C, 3] arrays.
    One jit(vmap) per (model, device); thousands of candidates cost one call."""
    if (dims, dev) not in _COMPILED:
        _COMPILED[dims, dev] = jax.jit(jax.vmap(lambda *a: _one(dims, dev, *a)))
    out = _COMPILED[dims, dev](jnp.asarray(k, jnp.float32), jnp.asarray(kind, jnp.int32),
                               jnp.asarray(layers, jnp.float32), jnp.asarray(alpha, jnp.float32))
    return jax.tree.map(np.asarray, out)


def conditional_acceptance(acceptance_rates: list[float]) -> np.ndarray:
    """Measured P(draft i accepted) (unconditional, from a run at some k) -> conditional a_i, padded
    to KMAX by repeating the last conditional rate (a run at k says nothing past k)."""
    rates = np.asarray(acceptance_rates, np.float64)
    prev = np.concatenate([[1.0], rates[:-1]])
    cond = np.where(prev > 0, rates / np.maximum(prev, 1e-12), 0.0)
    cond = np.clip(cond, 0.0, 1.0)
    out = np.full(KMAX, cond[-1] if len(cond) else 0.0)
    out[:len(cond)] = cond
    return out


__all__ = ["ModelDims", "predict", "expected_tokens", "conditional_acceptance", "KMAX", "COMPONENTS"]
