"""The cost model against hand-computed cases."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specjax.costmodel.hardware import DeviceModel, fit_to_ar
from specjax.costmodel.model import KMAX, ModelDims, conditional_acceptance, expected_tokens, predict

DEV = DeviceModel("test", bandwidth=1e9, flops=1e10, step_overhead=1e-3, round_overhead=2e-3,
                  peak_bandwidth=2e9, peak_flops=2e10)
# 1 MB per layer, 10 layers, 2 MB head, no KV: a full forward reads 12 MB
DIMS = ModelDims(layer_bytes=1e6, head_bytes=2e6, layer_flops=1e6, head_flops=2e6, kv_bytes_per_slot=0.0,
                 attn_flops_per_slot=0.0, num_layers=10, num_slots=64)


def alpha(a):
    return np.full((1, KMAX), a)


def test_ar_step_is_weights_over_bandwidth_plus_fixed_costs():
    p = predict(DIMS, DEV, [0], [0], [0], alpha(0.0))
    verify = 1e-3 + 12e6 / 1e9  # flops 12e6 / 1e10 = 1.2 ms < 12 ms: memory-bound
    assert p["component_time"][0, 0] == pytest.approx(verify)
    assert p["step_time"][0] == pytest.approx(verify + 1e-3)  # AR commit = half a round overhead
    assert p["tokens_per_s"][0] == pytest.approx(1 / (verify + 1e-3))
    assert p["ceiling_tokens_per_s"][0] == pytest.approx(1 / (12e6 / 2e9))


def test_wide_verify_turns_compute_bound():
    # k = 15: 16 tokens x 12 MFLOP = 192 MFLOP / 1e10 = 19.2 ms > 12 ms of weight reads
    p = predict(DIMS, DEV, [15], [1], [0], alpha(0.5))
    assert p["component_time"][0, 0] == pytest.approx(1e-3 + 19.2e-3)
    assert p["component_floor"][0, 0] == pytest.approx(max(12e6 / 2e9, 192e6 / 2e10))


def test_chain_expected_tokens_matches_closed_form():
    for a, k in [(0.6, 4), (0.8, 8), (0.9, 3)]:
        closed = (1 - a ** (k + 1)) / (1 - a)
        assert float(expected_tokens(np.full(KMAX, a), k)) == pytest.approx(closed, rel=1e-5)


def test_layer_skip_draft_cost_and_gaps():
    # K = 2 layers: each drafter forward reads 2 MB + 2 MB head = 4 ms + 1 ms fixed; k = 3 -> 3 forwards
    p = predict(DIMS, DEV, [3], [2], [2], alpha(1.0))
    assert p["component_time"][0, 1] == pytest.approx(3 * (1e-3 + 4e6 / 1e9))
    assert p["tokens_per_step"][0] == pytest.approx(4.0)
    gap = p["component_time"][0] - p["component_floor"][0]
    assert np.allclose(p["component_gap"][0], gap)
    assert p["component_floor"][0, 2] == 0.0  # commit has no physical floor


def test_vectorized_over_many_candidates():
    C = 4096
    rng = np.random.default_rng(0)
    k = rng.integers(1, 9, C)
    p = predict(DIMS, DEV, k, np.ones(C, int), np.zeros(C), rng.uniform(0, 1, (C, KMAX)))
    assert p["tokens_per_s"].shape == (C,) and np.all(p["tokens_per_s"] <= p["ceiling_tokens_per_s"])


def test_conditional_acceptance():
    a = conditional_acceptance([0.5, 0.25, 0.125])
    assert np.allclose(a[:4], [0.5, 0.5, 0.5, 0.5])
    assert conditional_acceptance([0.0, 0.0])[:2].tolist() == [0.0, 0.0]


def test_per_layer_overhead_and_host_cost_per_token():
    dev = dataclasses.replace(DEV, layer_overhead=1e-4, host_per_token=5e-4)
    # layer-skip K = 2, k = 3: each drafter forward: 1 ms + 2 x 0.1 ms fixed + 4 MB / 1 GB/s
    p = predict(DIMS, dev, [3], [2], [2], alpha(1.0))
    assert p["component_time"][0, 1] == pytest.approx(3 * (1.2e-3 + 4e-3))
    assert p["component_time"][0, 0] == pytest.approx(1e-3 + 10 * 1e-4 + 12e-3)  # verify: all 10 layers
    assert p["component_time"][0, 3] == pytest.approx(4 * 5e-4)  # host: 4 tokens per step
    assert p["component_floor"][0, 3] == 0.0


def test_fit_to_ar_recovers_commit_and_host_costs():
    # 100 tokens in 0.30 s, 0.25 s of it in the decode loop over 100 steps, forward 2 ms
    dev = fit_to_ar(DEV, ar_seconds=0.30, ar_decode_s=0.25, ar_steps=100, tokens=100, ar_forward_s=2e-3)
    assert dev.round_overhead == pytest.approx(2 * 0.5e-3)  # AR pays half a round: 0.5 ms per step
    assert dev.host_per_token == pytest.approx(0.05 / 100)
    p = predict(DIMS, dataclasses.replace(dev, step_overhead=0.0, bandwidth=6e9), [0], [0], [0], alpha(0.0))
    assert 1 / p["tokens_per_s"][0] == pytest.approx(2e-3 + 0.5e-3 + 0.5e-3)  # forward + commit + host


@pytest.mark.parametrize("kind", [3, 4])  # block drafter, and the replay drafter's block network
def test_block_draft_is_one_block_forward_plus_the_context_injection(kind):
    # L = 2 drafter layers over k + 1 = 4 positions: (2 MB layers + 2 MB head) / 1e9 + the fixed costs,
    # then the injection pass: 2 MB of layers, no head
    p = predict(DIMS, DEV, [3], [kind], [2], alpha(1.0))
    block = 1e-3 + 4e6 / 1e9
    inject = 1e-3 + 2e6 / 1e9
    assert p["component_time"][0, 1] == pytest.approx(block + inject)
    assert p["component_floor"][0, 1] == pytest.approx(4e6 / 2e9 + 2e6 / 2e9)
    deeper = predict(DIMS, DEV, [3], [kind], [4], alpha(1.0))
    assert deeper["component_time"][0, 1] > p["component_time"][0, 1]
    assert p["tokens_per_step"][0] == pytest.approx(4.0)


def test_tree_verify_reads_once_over_all_nodes_and_counts_depth():
    # k = 3, a tree of 12 drafted nodes: one verify over 13 tokens (13 x 12 MFLOP = 156 MFLOP:
    # 15.6 ms compute-bound vs 12 ms of reads); acceptance counted to depth min(k, N) = 3
    p = predict(DIMS, DEV, [3], [3], [2], alpha(1.0), tree_nodes=[12])
    assert p["component_time"][0, 0] == pytest.approx(1e-3 + 156e6 / 1e10)
    assert p["tokens_per_step"][0] == pytest.approx(4.0)
    chain = predict(DIMS, DEV, [3], [3], [2], alpha(1.0))
    assert chain["component_time"][0, 0] == pytest.approx(1e-3 + 12e6 / 1e9)


def test_hybrid_target_dims_count_its_weights_kv_and_state():
    """A hybrid target's average layer: its weights add up to the parameters' bytes (the embedding,
    gathered not streamed, apart), KV only for attention layers, the GDN state read and written per
    step; and the device fit times its real forwards."""
    import jax

    from specjax.costmodel.hardware import fit_to_target
    from specjax.models.hybrid import init_random_hybrid_params
    from test_hybrid_decoding import hybrid_config
    cfg = dataclasses.replace(hybrid_config(3), tie_word_embeddings=False)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(0))
    d = ModelDims.of(cfg, 64)
    weights = sum(x.nbytes for x in jax.tree.leaves(params)) - params.embed.nbytes
    state = 3 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    assert d.num_layers * d.layer_bytes + d.head_bytes == pytest.approx(weights + 3 * state, rel=1e-9)
    assert d.kv_bytes_per_slot * d.num_layers == 2 * cfg.kv_size * 4 * len(cfg.attn_layers)
    fitted = fit_to_target(DEV, cfg, params, num_slots=64, widths=(1, 4))
    assert fitted.step_overhead > 0 and "target-fit" in fitted.source


# ----------------------------------------------------------------------------- batching terms

def batched(b):
    return dataclasses.replace(DIMS, batch=b)


def serving(c, budget=0, packed=0, steps=0, k1=0):
    return dict(budget=np.full(c, budget), packed=np.full(c, packed), steps_per_call=np.full(c, steps),
                two_level_k1=np.full(c, k1))


def test_batch_of_one_with_mechanisms_off_is_unchanged():
    plain = predict(DIMS, DEV, [4], [1], [0], alpha(0.6))
    off = predict(batched(1), DEV, [4], [1], [0], alpha(0.6), **serving(1))
    assert off["step_time"][0] == plain["step_time"][0]
    assert off["tokens_per_step"][0] == plain["tokens_per_step"][0]


def test_batch_shares_the_weight_read_and_multiplies_tokens():
    # B = 8, k = 3 padded: 32 tokens x 12 MFLOP = 384 MFLOP / 1e10 = 38.4 ms > 12 ms: compute-bound
    p = predict(batched(8), DEV, [3], [1], [0], alpha(0.5), **serving(1))
    assert p["component_time"][0, 0] == pytest.approx(1e-3 + 38.4e-3)
    assert p["tokens_per_step"][0] == pytest.approx(8 * expected_tokens(np.full(KMAX, 0.5), 3))


def test_budget_and_packing_cut_compute_bound_verify():
    # B = 8, k = 3; budget 8 drafts: one each (d = 1); packed: 8 x 2 = 16 tokens = 19.2 ms
    args = (batched(8), DEV, [3], [1], [0], alpha(0.5))
    padded = predict(*args, **serving(1))
    budget_padded = predict(*args, **serving(1, budget=8))
    packed = predict(*args, **serving(1, budget=8, packed=1))
    assert budget_padded["component_time"][0, 0] == padded["component_time"][0, 0]  # padding pays all
    assert packed["component_time"][0, 0] == pytest.approx(1e-3 + 19.2e-3)
    assert packed["tokens_per_step"][0] == pytest.approx(8 * 1.5)  # 1 + 0.5 per slot


def test_two_level_pays_its_second_pass_only_when_someone_passes():
    # k1 = 1 of k = 3, B = 2 padded: level 1 = 4 tokens (memory-bound, 12 ms), level 2 = 4 tokens,
    # run with probability 1 - (1 - a)^2
    for a, p_any in [(0.0, 0.0), (0.5, 0.75), (1.0, 1.0)]:
        p = predict(batched(2), DEV, [3], [1], [0], alpha(a), **serving(1, steps=1, k1=1))
        assert p["component_time"][0, 0] == pytest.approx((1 + p_any) * (1e-3 + 12e-3))


def test_two_level_token_cap_shrinks_level_two_and_the_reach_of_promoted_slots():
    # B = 8 packed, k1 = 1 of k = 3, a = 0.5: level 2 would verify 8 x 2 = 16 tokens; a cap of 2
    # verifies 2, shared by the ~8 x 0.5 = 4 promoted slots: each reaches 1 + 2 / 4 = 1.5 drafts
    args = (batched(8), DEV, [3], [1], [0], alpha(0.5))
    plain = predict(*args, **serving(1, packed=1, steps=1, k1=1))
    capped = predict(*args, **serving(1, packed=1, steps=1, k1=1), two_level_tokens=np.full(1, 2.0))
    wide_cap = predict(*args, **serving(1, packed=1, steps=1, k1=1), two_level_tokens=np.full(1, 1e6))
    unpacked = predict(*args, **serving(1, steps=1, k1=1), two_level_tokens=np.full(1, 2.0))
    p_any = 1 - 0.5 ** 8
    level1 = 1e-3 + 16 * 1.2e-3  # 8 x (k1 + 1) tokens, compute-bound as in the tests above
    assert capped["component_time"][0, 0] == pytest.approx(level1 + p_any * (1e-3 + 12e-3))
    assert capped["component_time"][0, 0] < plain["component_time"][0, 0]
    # depth 1.5 counts the second draft (fractional depths round up, as the budget's d = budget / B)
    assert capped["tokens_per_step"][0] == pytest.approx(8 * (1 + 0.5 + 0.25))
    assert capped["tokens_per_step"][0] < plain["tokens_per_step"][0]
    # a cap above level 2's tokens changes nothing; padded verification ignores the cap
    assert wide_cap["component_time"][0, 0] == plain["component_time"][0, 0]
    assert wide_cap["tokens_per_step"][0] == plain["tokens_per_step"][0]
    padded = predict(*args, **serving(1, steps=1, k1=1))
    assert unpacked["component_time"][0, 0] == padded["component_time"][0, 0]
    assert unpacked["tokens_per_step"][0] == padded["tokens_per_step"][0]
    from specjax.search.registry import REGISTRY
    on = {"drafter.kind": "ngram", "drafter.k": 3, "serving.steps_per_call": 4, "serving.packed": "on",
          "serving.two_level_k1": 1, "serving.two_level_tokens": 5}
    assert REGISTRY.apply(on)["serving"].two_level_tokens == 5
    assert REGISTRY.features(on)["serving_k2_tokens"] == 5.0
    for off in ({"serving.packed": "off"}, {"serving.two_level_k1": 0}):  # the cap needs both
        assert REGISTRY.apply(dict(on, **off))["serving"].two_level_tokens is None
        assert REGISTRY.features(dict(on, **off))["serving_k2_tokens"] == 0.0


def test_host_round_trip_is_spread_over_steps_per_call():
    host = [predict(batched(4), DEV, [3], [1], [0], alpha(0.5), **serving(1, steps=s))["component_time"][0, 3]
            for s in (0, 1, 16)]
    assert host[1] - host[0] == pytest.approx(DEV.host_sync)
    assert host[2] - host[0] == pytest.approx(DEV.host_sync / 16)


def test_gathered_paged_attention_reads_the_cache_three_times():
    # a memory-bound verify (B = 2, k = 1): the kernel reads every slot's KV once, XLA's gather three
    # times; the floor is the single read either way, so the gather shows up as a verify gap
    dims = dataclasses.replace(batched(2), num_slots=4096, kv_bytes_per_slot=256.0)
    args = (dims, DEV, [1], [1], [0], alpha(0.5))
    kernel = predict(*args, **serving(1, steps=1), kv_passes=np.ones(1))
    gather = predict(*args, **serving(1, steps=1), kv_passes=np.full(1, 3.0))
    kv_read = 2 * 4096 * dims.kv_bytes_per_slot * dims.num_layers / DEV.bandwidth
    assert kv_read > 0 and gather["component_time"][0, 0] - kernel["component_time"][0, 0] == pytest.approx(2 * kv_read)
    assert gather["component_floor"][0, 0] == kernel["component_floor"][0, 0]
    from specjax.search.registry import REGISTRY
    on = {"drafter.kind": "ngram", "drafter.k": 3, "serving.steps_per_call": 4}
    assert REGISTRY.features(on)["serving_kv_passes"] == 3.0
    assert REGISTRY.features(dict(on, **{"serving.attention": "kernel"}))["serving_kv_passes"] == 1.0
    assert REGISTRY.apply(dict(on, **{"serving.attention": "kernel"}))["serving"].attention == "xla"  # CPU


def test_tensor_parallel_splits_the_read_and_pays_the_collectives():
    # memory-bound AR (12 MB at 1 GB/s = 12 ms): tp = 4 reads 3 ms a device, plus per layer two
    # all-reduces of [1, 64] float32 and one gather of [1, 100] float32 logits
    dims = dataclasses.replace(DIMS, hidden=64, vocab=100, act_bytes=4)
    dev = dataclasses.replace(DEV, link_bandwidth=1e8, collective_latency=1e-5)
    one = predict(dims, dev, [0], [0], [0], alpha(0.5))
    four = predict(dataclasses.replace(dims, tp=4), dev, [0], [0], [0], alpha(0.5))
    comm = 10 * 2 * (1e-5 + 2 * 0.75 * 64 * 4 / 1e8) + (1e-5 + 0.75 * 100 * 4 / 1e8)
    assert one["component_time"][0, 0] == pytest.approx(1e-3 + 12e-3)
    assert four["component_time"][0, 0] == pytest.approx(1e-3 + 3e-3 + comm)
