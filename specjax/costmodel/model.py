"""Step-time model: per component, time = max(bytes / bandwidth, flops / rate) + fixed costs; the
ceiling puts every component at its physical floor (bytes / peak bandwidth, flops / peak rate, no
fixed costs) with the same acceptance. Pure JAX: `predict` is jit + vmap over candidate arrays.

Weight formats: a forward's weight read is split into groups (attn, mlp, head); a group in LH12
reads bits/16 of its bf16 bytes at `DeviceModel.lh12_efficiency` of the bandwidth, tuned kernel
tiles run at `tuned_efficiency`, and our Pallas GEMMs (which 12-bit weights and tuned tiles imply)
at `pallas_efficiency` of XLA's. All-bf16 XLA with default tiles subtracts an exact zero, so it predicts
bit for bit what the model did before formats existed. Floors take the fewer bytes, never the
efficiencies (nothing beats bytes / peak bandwidth).

Components: verify (one target forward over k + 1 tokens, weights + KV read once), draft (the
proposer's forwards: none for n-gram, k narrow forwards of the first K layers for layer-skip; for
block and replay drafters, one forward of their L target-shaped layers and the shared head over the
k + 1 block positions, plus the pass that injects the accepted positions' features into their
L layers' K/V (no head)), commit
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
from specjax.models.hybrid_config import HybridConfig
from specjax.search.registry import COMPONENTS, LH12_NOMINAL_BITS, WEIGHT_GROUPS

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
    # Per weight group, the bytes a format can shrink (0: unknown, no format moves the forward).
    attn_bytes: float = 0.0  # w_qkv + w_o of one layer, part of layer_bytes
    mlp_bytes: float = 0.0  # w_gate_up + w_down of one layer, part of layer_bytes
    head_matrix_bytes: float = 0.0  # lm_head (or the tied embedding), part of head_bytes
    # The target's own LH12 bits per weight per group (attn, mlp, head), tensors that stay bf16
    # counted at 16; None: the registry's per-config factor (LH12_NOMINAL_BITS / 16).
    lh12_bits: tuple[float, float, float] | None = None
    batch: int = 1  # requests per step (the deployment's); each has num_slots of KV
    # Tensor parallelism (docs/design/tensor_parallel.md): tp devices split the weights, the KV and
    # the flops; each layer all-reduces its two row-parallel outputs ([tokens, hidden] activations
    # of act_bytes each) and the head gathers the logits.
    tp: int = 1
    hidden: int = 0
    vocab: int = 0
    act_bytes: int = 2

    @staticmethod
    def of(cfg: ModelConfig, num_slots: int, lh12_bits: tuple[float, float, float] | None = None
           ) -> "ModelDims":
        if isinstance(cfg, HybridConfig):
            return ModelDims.of_hybrid(cfg, num_slots)
        item = 4 if cfg.dtype == "float32" else 2
        D, F = cfg.hidden_size, cfg.intermediate_size
        attn_params = D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D
        mlp_params = 3 * D * F
        layer_params = attn_params + mlp_params + 2 * D
        head_params = cfg.vocab_size * D + D
        return ModelDims(layer_bytes=layer_params * item, head_bytes=head_params * item,
                         layer_flops=2.0 * layer_params, head_flops=2.0 * head_params,
                         kv_bytes_per_slot=2.0 * cfg.kv_size * item,
                         attn_flops_per_slot=4.0 * cfg.q_size, num_layers=cfg.num_layers,
                         num_slots=num_slots, attn_bytes=float(attn_params * item),
                         mlp_bytes=float(mlp_params * item),
                         head_matrix_bytes=float(cfg.vocab_size * D * item),
                         lh12_bits=None if lh12_bits is None else tuple(float(b) for b in lh12_bits),
                         hidden=D, vocab=cfg.vocab_size, act_bytes=item)


    @staticmethod
    def of_hybrid(cfg: HybridConfig, num_slots: int) -> "ModelDims":
        """A hybrid target as an average layer: its GDN and attention layers' weights, the KV of
        its attention layers only, and each GDN layer's recurrent state, which a step reads and
        writes like a weight (verify reads it, the commit's replay reads and writes it: 3 passes).
        Weight formats do not apply (attn/mlp bytes 0: the 12-bit kernels serve dense targets)."""
        item = 4 if cfg.dtype == "float32" else 2
        D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
        attn = D * (2 * cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D + 2 * cfg.head_dim  # + q/k norms
        gdn = (D * cfg.in_proj_size + cfg.value_dim * D + cfg.linear_conv_kernel_dim * cfg.conv_dim
               + 2 * cfg.linear_num_value_heads + cfg.linear_value_head_dim)  # + A_log, dt_bias, norm
        state = 3 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        mixer_params = (n_attn * attn + n_gdn * gdn) / L
        layer_params = mixer_params + 3 * D * F + 2 * D
        head_params = cfg.vocab_size * D + D
        return ModelDims(layer_bytes=layer_params * item + state * n_gdn / L, head_bytes=head_params * item,
                         layer_flops=2.0 * layer_params, head_flops=2.0 * head_params,
                         kv_bytes_per_slot=2.0 * cfg.kv_size * item * n_attn / L,
                         attn_flops_per_slot=4.0 * cfg.q_size * n_attn / L, num_layers=L,
                         num_slots=num_slots, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
                         act_bytes=4 if cfg.dtype == "float32" else 2)


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """One candidate's weight read, per group (attn, mlp, head): the fraction of its bf16 bytes
    read (`fraction`, [3]) and the bandwidth efficiency of its kernel (`efficiency`, [3]).
    Built inside the jit: a plain container of traced arrays."""
    fraction: jax.Array
    efficiency: jax.Array

    @staticmethod
    def of(dims: ModelDims, dev: DeviceModel, bytes_factor, lh12, tuned, pallas=0.0) -> "WeightPlan":
        lh12 = lh12 > 0
        if dims.lh12_bits is not None:  # the target's own figure beats the nominal one
            bits = jnp.asarray(dims.lh12_bits, jnp.float32)
            bytes_factor = jnp.where(lh12, bits / 16.0, bytes_factor)
            lh12 = lh12 & (bits < 16.0)  # a group whose tensors all stay bf16 runs the bf16 kernel
        # lh12 and tuned efficiencies are relative to our bf16 kernel; pallas_efficiency puts that
        # kernel against XLA's GEMMs (the all-bf16 XLA baseline stays an exact 1.0)
        eff = (jnp.where(lh12, dev.lh12_efficiency, 1.0) * jnp.where(tuned > 0, dev.tuned_efficiency, 1.0)
               * jnp.where(pallas > 0, dev.pallas_efficiency, 1.0))
        return WeightPlan(fraction=bytes_factor, efficiency=eff)


def _saved_bytes(dims: ModelDims, wp: WeightPlan, layers, peak: bool):
    """bf16 bytes a forward does not pay for: a group reading a fraction f of its bytes at
    efficiency e costs the time of f / e of them (floors: e = 1). With f = e = 1 every term is an
    exact zero."""
    eff = 1.0 if peak else wp.efficiency
    saved = 1.0 - wp.fraction / eff
    return layers * (dims.attn_bytes * saved[0] + dims.mlp_bytes * saved[1]) + dims.head_matrix_bytes * saved[2]


def _forward_time(dims: ModelDims, dev: DeviceModel, layers, tokens, peak: bool, wp: WeightPlan,
                  kv_passes=1.0):
    # every request's cache, read once (kv_passes > 1: a paged cache gathered into a view first)
    kv = dims.batch * dims.num_slots * dims.kv_bytes_per_slot * kv_passes
    bytes_ = layers * (dims.layer_bytes + kv) + dims.head_bytes
    flops = tokens * (layers * (dims.layer_flops + dims.num_slots * dims.attn_flops_per_slot) + dims.head_flops)
    bw = dev.peak_bandwidth if peak else dev.bandwidth
    rate = dev.peak_flops if peak else dev.flops
    fixed = 0.0 if peak else dev.step_overhead + layers * dev.layer_overhead
    # the all-bf16 read time first, exactly as before formats, then the formats' saving off it
    read = bytes_ / bw - _saved_bytes(dims, wp, layers, peak) / bw
    if dims.tp == 1:
        return fixed + jnp.maximum(read, flops / rate)
    return fixed + jnp.maximum(read / dims.tp, flops / (rate * dims.tp)) + _tp_comm_time(dims, dev, layers, tokens)


def _tp_comm_time(dims: ModelDims, dev: DeviceModel, layers, tokens):
    """A forward's collectives under tensor parallelism: per layer two ring all-reduces of the
    [tokens, hidden] activations (each moves 2 (tp - 1) / tp of them per device), and one
    all-gather of the logits. Not overlapped with the weight read (a conservative bound)."""
    n = dims.tp
    ring = (n - 1) / n
    all_reduce = dev.collective_latency + 2.0 * ring * tokens * dims.hidden * dims.act_bytes / dev.link_bandwidth
    gather = dev.collective_latency + ring * tokens * dims.vocab * 4.0 / dev.link_bandwidth
    return layers * 2.0 * all_reduce + gather


def expected_tokens(alpha, k):
    """alpha [KMAX] conditional acceptance per position, k draft length -> E[tokens per step]."""
    idx = jnp.arange(KMAX)
    survive = jnp.cumprod(jnp.where(idx < k, alpha, 0.0))
    return 1.0 + jnp.sum(survive)


def _block_draft_time(dims: ModelDims, dev: DeviceModel, layers, k, peak: bool, wp: WeightPlan):
    """Block (and replay) drafters: the block forward (L layers + head over k + 1 positions) and the
    context injection (L layers over up to k + 1 accepted positions, no head)."""
    no_head = dataclasses.replace(dims, head_bytes=0.0, head_flops=0.0, head_matrix_bytes=0.0)
    tokens = dims.batch * (k + 1)
    return (_forward_time(dims, dev, layers, tokens, peak, wp) +
            _forward_time(no_head, dev, layers, tokens, peak, wp))


def _verify_batched(dims, dev, alpha, width, depth, budget, packed, k1, peak, wp, kv_passes=1.0,
                    level2_cap=0.0):
    """Batched verification (serving mechanisms) -> (verify time, drafts each slot verifies).
    B requests per step: padded, every slot takes `width` tokens; a budget spreads `budget` drafts
    over the batch (equal acceptance: budget / B each); packed, only verified tokens are computed;
    two-level (k1 > 0) verifies k1 + 1 tokens per slot, then the rest with the probability that
    some slot passed all k1 drafts; `level2_cap` > 0 (two_level_tokens, packed chains) caps level
    2 at that many tokens, shared by the ~B p_pass promoted slots, which then reach that far."""
    B = dims.batch
    d = jnp.where(budget > 0, jnp.minimum(depth, budget / B), depth)
    one = jnp.where(packed > 0, B * (1.0 + d), B * width)
    single = _forward_time(dims, dev, dims.num_layers, one, peak, wp, kv_passes)
    k1 = jnp.minimum(k1, jnp.maximum(depth - 1, 0))
    t1 = jnp.where(packed > 0, B * (1.0 + jnp.minimum(k1, d)), B * (k1 + 1.0))
    t2 = jnp.where(packed > 0, B * jnp.maximum(d - k1, 0.0), B * (width - 1.0 - k1))
    idx = jnp.arange(KMAX)
    p_pass = jnp.prod(jnp.where(idx < k1, alpha, 1.0))
    p_any = 1.0 - (1.0 - p_pass) ** B
    capped = (k1 > 0) & (packed > 0) & (level2_cap > 0)
    t2 = jnp.where(capped, jnp.minimum(t2, level2_cap), t2)
    reach = jnp.where(capped, jnp.minimum(d, k1 + level2_cap / jnp.maximum(B * p_pass, 1e-6)), d)
    two = (_forward_time(dims, dev, dims.num_layers, t1, peak, wp, kv_passes) +
           p_any * _forward_time(dims, dev, dims.num_layers, t2, peak, wp, kv_passes))
    return jnp.where(k1 > 0, two, single), reach


def _one(dims: ModelDims, dev: DeviceModel, k, kind, layers, alpha, bytes_factor, lh12, tuned, pallas,
         tree_nodes, budget, packed, steps_per_call, two_level_k1, kv_passes, two_level_tokens):
    """Component times, floors and rates for one candidate (kind: 0 none, 1 ngram, 2 layerskip,
    3 block, 4 replay (the drafter network of a block drafter; its acceptance is the profile's);
    bytes_factor, lh12 [3] per weight group; tuned, pallas 0/1 flags (tuned tiles; our Pallas GEMMs
    instead of XLA's); the serving mechanisms: budget
    (draft tokens per step, 0: none), packed 0/1, steps_per_call (0: the batch engine, whole
    decode on the device; n: the serving engine, a host sync every n steps), two_level_k1,
    kv_passes (passes over the KV cache: 3 for a paged cache XLA gathers, 1 for the kernel or a
    contiguous cache), two_level_tokens (level 2's token cap, 0: none).
    Times are per step of the whole batch (dims.batch requests)."""
    wp = WeightPlan.of(dims, dev, bytes_factor, lh12, tuned, pallas)
    speculative = kind > 0
    k = jnp.where(speculative, k, 0)
    # a tree of N drafted nodes: one verify over N + 1 tokens; its acceptance profile is per depth,
    # at most min(k, N) deep
    width = jnp.where(tree_nodes > 0, tree_nodes, k) + 1
    depth = jnp.where(tree_nodes > 0, jnp.minimum(k, tree_nodes), k)
    verify, d = _verify_batched(dims, dev, alpha, width, depth, budget, packed, two_level_k1, False, wp,
                                kv_passes, two_level_tokens)
    # the floor reads the cache once whatever the attention does: a gather is a gap, not a floor
    verify_floor, _ = _verify_batched(dims, dev, alpha, width, depth, budget, packed, two_level_k1, True, wp,
                                      1.0, two_level_tokens)
    B = dims.batch
    # layer-skip: one width-2 catch-up forward (k + 1 wide under trees: an accepted path may leave
    # the drafter's chain), then k - 1 width-1 forwards of the first K layers (the target's own
    # layers and head, so the same weight formats)
    catch_up = jnp.where(tree_nodes > 0, k + 1, 2)
    ls = jnp.where(k > 0, _forward_time(dims, dev, layers, B * catch_up, False, wp) +
                   (k - 1) * _forward_time(dims, dev, layers, B, False, wp), 0.0)
    ls_floor = jnp.where(k > 0, _forward_time(dims, dev, layers, B * catch_up, True, wp) +
                         (k - 1) * _forward_time(dims, dev, layers, B, True, wp), 0.0)
    block = jnp.where(k > 0, _block_draft_time(dims, dev, layers, k, False, wp), 0.0)
    block_floor = jnp.where(k > 0, _block_draft_time(dims, dev, layers, k, True, wp), 0.0)
    draft = jnp.select([kind == 1, kind == 2, kind >= 3], [dev.step_overhead * 0.25, ls, block], 0.0)
    draft_floor = jnp.select([kind == 2, kind >= 3], [ls_floor, block_floor], 0.0)
    commit = jnp.where(speculative, dev.round_overhead, dev.round_overhead * 0.5)
    tokens = B * jnp.where(speculative, expected_tokens(alpha, d), 1.0)
    host = tokens * dev.host_per_token  # paid per token, so per step it scales with tokens per step
    # the serving engine reads progress back once per call: one synchronizing host round trip
    host = host + jnp.where(steps_per_call > 0, dev.host_sync / jnp.maximum(steps_per_call, 1), 0.0)
    times = jnp.stack([verify, draft, commit, host])
    floors = jnp.stack([verify_floor, draft_floor, 0.0 * commit, 0.0 * host])
    return dict(tokens_per_step=tokens, step_time=times.sum(), floor_time=floors.sum(),
                tokens_per_s=tokens / times.sum(), ceiling_tokens_per_s=tokens / floors.sum(),
                component_time=times, component_floor=floors, component_gap=times - floors)


_COMPILED: dict = {}


def predict(dims: ModelDims, dev: DeviceModel, k, kind, layers, alpha, bytes_factor=None, lh12=None,
            tuned=None, tree_nodes=None, budget=None, packed=None, steps_per_call=None,
            two_level_k1=None, kv_passes=None, pallas=None, two_level_tokens=None) -> dict:
    """Vectorized over candidates: k, kind, layers [C]; alpha [C, KMAX]; per weight group
    bytes_factor and lh12 [C, 3] (default all bf16); tuned [C] (default: default tiles); pallas [C]
    (default: XLA GEMMs); tree_nodes
    [C] (default 0: chains)
    -> dict of [C] / [C, 4] arrays. One jit(vmap) per (model, device); thousands of candidates
    cost one call."""
    c = len(np.atleast_1d(k))
    groups = len(WEIGHT_GROUPS)
    bytes_factor = np.ones((c, groups)) if bytes_factor is None else bytes_factor
    lh12 = np.zeros((c, groups)) if lh12 is None else lh12
    tuned = np.zeros(c) if tuned is None else tuned
    pallas = np.zeros(c) if pallas is None else pallas
    tree_nodes = np.zeros(c) if tree_nodes is None else tree_nodes
    serving = [np.zeros(c) if x is None else x for x in (budget, packed, steps_per_call, two_level_k1)]
    serving.append(np.ones(c) if kv_passes is None else kv_passes)
    serving.append(np.zeros(c) if two_level_tokens is None else two_level_tokens)
    if (dims, dev) not in _COMPILED:
        _COMPILED[dims, dev] = jax.jit(jax.vmap(lambda *a: _one(dims, dev, *a)))
    out = _COMPILED[dims, dev](jnp.asarray(k, jnp.float32), jnp.asarray(kind, jnp.int32),
                               jnp.asarray(layers, jnp.float32), jnp.asarray(alpha, jnp.float32),
                               jnp.asarray(bytes_factor, jnp.float32), jnp.asarray(lh12, jnp.float32),
                               jnp.asarray(tuned, jnp.float32), jnp.asarray(pallas, jnp.float32),
                               jnp.asarray(tree_nodes, jnp.float32),
                               *(jnp.asarray(x, jnp.float32) for x in serving))
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


__all__ = ["ModelDims", "WeightPlan", "LH12_NOMINAL_BITS", "predict", "expected_tokens", "conditional_acceptance", "KMAX", "COMPONENTS"]
