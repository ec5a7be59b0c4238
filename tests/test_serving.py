"""The serving engine (continuous batching, paged KV) is token-identical to AR decoding for every
request, with each batching mechanism on and off, every drafter, and requests arriving and leaving
at any step; bad input gets clear errors and leaves the other requests alone."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import humaneval_prompts, tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.block import init_block_drafter
from specjax.drafters.model_drafter import layer_skip_drafter, small_model_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.models.params import init_random_params
from specjax.serving import QueueFullError, ServingEngine, ServingOptions
from specjax.serving.forcing import check_serving_forcing

TOL = 1e-3
MECHANISMS = {
    "stock": ServingOptions(),
    "budget": ServingOptions(budget=5),
    "packed": ServingOptions(packed=True),
    "device_loop": ServingOptions(steps_per_call=8),
    "two_level": ServingOptions(two_level_k1=2),
    "all": ServingOptions(budget=6, packed=True, steps_per_call=8, two_level_k1=1, two_level_tokens=2),
}


def make_drafter(kind, cfg, params, k, seed=0):
    if kind == "ngram":
        return NgramDrafter(k=k)
    if kind == "layerskip":
        return layer_skip_drafter(params, cfg, max(1, cfg.num_layers - 1), k)
    if kind == "block":
        return init_block_drafter(params, cfg, jax.random.PRNGKey(seed + 5), k + 1, 1,
                                  [0, cfg.num_layers - 1], conv=True, scale=0.5)
    small_cfg = dataclasses.replace(cfg, num_layers=1, hidden_size=16, intermediate_size=32)
    small = init_random_params(small_cfg, jax.random.PRNGKey(seed + 1), scale=0.5)
    return small_model_drafter(small, small_cfg, cfg, k)


def random_prompts(rng, n, alphabet, lo=2, hi=30):
    return [rng.integers(0, alphabet, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def assert_forcing(engine, prompts, reference, max_new):
    report = check_serving_forcing(engine, prompts, reference, max_new, tolerance=TOL)
    assert report.passed, report.summary() + "\n" + "\n".join(map(str, report.failures[:10]))
    return report


@pytest.fixture(scope="module")
def tiny():
    cfg, params = tiny_model(seed=1)
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, 7, 8)
    gen = GenerationConfig(max_new_tokens=20)
    return cfg, params, prompts, Decoder(cfg, params, gen).generate(prompts)


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_each_mechanism_passes_forcing(tiny, mechanism):
    cfg, params, prompts, reference = tiny
    engine = ServingEngine(cfg, params, NgramDrafter(k=4), num_slots=3, slot_len=64, page_size=8,
                           options=MECHANISMS[mechanism], forcing=True)
    assert_forcing(engine, prompts, reference, 20)


@pytest.mark.parametrize("kind", ["ngram", "layerskip", "small", "block"])
def test_free_running_equals_ar_for_every_drafter(kind):
    """No forcing: each request's own output equals AR's, with slots recycled mid-run."""
    cfg, params = tiny_model(seed=3, num_layers=2)
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, 6, 10)
    gen = GenerationConfig(max_new_tokens=16, stop_tokens=(3,))
    reference = Decoder(cfg, params, gen).generate(prompts)
    assert all(min(m) >= TOL for m in reference.margins)  # no near-ties: outputs must be equal
    engine = ServingEngine(cfg, params, make_drafter(kind, cfg, params, 3), num_slots=2, slot_len=64,
                           page_size=4, stop_tokens=(3,), options=MECHANISMS["all"] if kind == "block"
                           else ServingOptions(two_level_k1=1, packed=True))
    rids = [engine.submit(p, 16) for p in prompts]
    results = engine.run()
    assert [results[r].tokens for r in rids] == reference.tokens
    assert all(results[r].status == "finished" for r in rids)


def test_ar_serving_equals_ar():
    cfg, params = tiny_model(seed=4)
    prompts = random_prompts(np.random.default_rng(2), 5, 20)
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=12)).generate(prompts)
    engine = ServingEngine(cfg, params, None, num_slots=2, slot_len=48, page_size=16, prompt_width=30,
                           options=ServingOptions(packed=True, steps_per_call=4), forcing=True)
    assert_forcing(engine, prompts, reference, 12)


@pytest.mark.parametrize("seed", range(4))
def test_random_configs_and_mechanisms(seed):
    """Random dense configs, drafters, k, slot counts, page sizes and mechanism combinations."""
    rng = np.random.default_rng(100 + seed)
    cfg = _random_config(rng)
    params = init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    k = int(rng.integers(1, 6))
    kind = ["ngram", "layerskip", "small", "block"][seed % 4]
    packed = bool(rng.random() < 0.6)
    k1 = None if k == 1 or rng.random() < 0.5 else int(rng.integers(1, k))
    opts = ServingOptions(
        budget=None if rng.random() < 0.4 else int(rng.integers(1, 3 * k + 1)), packed=packed,
        steps_per_call=int(rng.choice([1, 3, 16])), two_level_k1=k1,
        two_level_tokens=int(rng.integers(1, 4)) if packed and k1 and rng.random() < 0.5 else None)
    prompts = random_prompts(rng, int(rng.integers(3, 9)), int(rng.integers(2, cfg.vocab_size)), 1, 24)
    max_new = int(rng.integers(1, 24))
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=max_new)).generate(prompts)
    engine = ServingEngine(cfg, params, make_drafter(kind, cfg, params, k, seed), forcing=True,
                           num_slots=int(rng.integers(1, 5)), slot_len=64,
                           page_size=int(rng.choice([1, 4, 16])), options=opts)
    order = rng.permutation(len(prompts)).tolist()
    assert_forcing_in_order(engine, prompts, reference, max_new, order)


def assert_forcing_in_order(engine, prompts, reference, max_new, order):
    report = check_serving_forcing(engine, prompts, reference, max_new, tolerance=TOL, submit_order=order)
    assert report.passed, report.summary() + "\n" + "\n".join(map(str, report.failures[:10]))


def _random_config(rng):
    """A random small dense config drawn with numpy (the hypothesis strategy's space)."""
    from specjax.models.config import ModelConfig, RopeScaling
    kv = int(rng.choice([1, 2, 4]))
    scaling = [None, RopeScaling("linear", 2.0), RopeScaling("llama3", 4.0, 1.0, 4.0, 16)][rng.integers(3)]
    return ModelConfig(
        vocab_size=int(rng.integers(8, 97)), hidden_size=int(rng.choice([16, 32])),
        intermediate_size=int(rng.choice([24, 64])), num_layers=int(rng.integers(2, 4)),
        num_heads=kv * int(rng.choice([1, 2])), num_kv_heads=kv, head_dim=int(rng.choice([4, 8, 12])),
        rope_theta=float(rng.choice([100.0, 10000.0])), rope_scaling=scaling,
        tie_word_embeddings=bool(rng.random() < 0.5), qk_norm=bool(rng.random() < 0.5),
        attention_bias=bool(rng.random() < 0.5), max_position_embeddings=256)


def test_smollm2_humaneval_all_mechanisms(smollm2):
    prompts = [smollm2.tokenizer.encode(p) for p in humaneval_prompts()[10:13]]
    gen = GenerationConfig(max_new_tokens=24, stop_tokens=smollm2.tokenizer.eos_ids)
    reference = Decoder(smollm2.cfg, smollm2.params, gen).generate(prompts)
    width = max(len(p) for p in prompts)
    engine = ServingEngine(smollm2.cfg, smollm2.params, NgramDrafter(k=5), num_slots=2,
                           slot_len=-(-(width + 32) // 16) * 16, page_size=16, prompt_width=width,
                           stop_tokens=smollm2.tokenizer.eos_ids, forcing=True,
                           options=ServingOptions(budget=6, packed=True, steps_per_call=4, two_level_k1=2))
    assert_forcing(engine, prompts, reference, 24)


@pytest.mark.parametrize("verify", ["chains", "trees"])
def test_soak_thousand_requests(verify):
    """1,000 requests of random lengths, arriving at random steps, some cancelled: every other
    request finishes, exactly (forced along its AR reference); chains with every mechanism, or
    trees with the budget, packing and device-resident steps."""
    from specjax.trees.builders import TreeSpec
    cfg, params = tiny_model(seed=6, vocab_size=24, num_layers=2, hidden_size=16, intermediate_size=32)
    rng = np.random.default_rng(7)
    n, max_new = 1000, 12
    prompts = random_prompts(rng, n, 6, 1, 12)
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=max_new)).generate(prompts)
    opts = (ServingOptions(budget=24, packed=True, steps_per_call=4, two_level_k1=1) if verify == "chains" else
            ServingOptions(budget=40, packed=True, steps_per_call=4, tree=TreeSpec("topk", 5, 3)))
    engine = ServingEngine(cfg, params, NgramDrafter(k=3, vocab_size=24), num_slots=16, slot_len=32,
                           page_size=4, num_pages=60, queue_len=16, prompt_width=12, forcing=True,
                           options=opts)
    pending = list(range(n))
    rids, cancelled = {}, set()
    while pending or not engine.idle:
        for _ in range(int(rng.integers(0, 12))):  # arrivals this call
            if pending:
                i = pending.pop(0)
                rids[i] = engine.submit(prompts[i], max_new, reference=reference.tokens[i])
        if rids and rng.random() < 0.05:
            victim = rids[int(rng.choice(list(rids)))]
            if victim not in engine.results:
                engine.cancel(victim)
                cancelled.add(victim)
        engine.step()
    assert len(engine.results) == n
    bad = []
    for i, rid in rids.items():
        res = engine.results[rid]
        if rid in cancelled:
            assert res.status == "cancelled"
            assert res.tokens == reference.tokens[i][:len(res.tokens)]
            continue
        assert res.status == "finished"
        lo = len(prompts[i])
        f = res.forced
        hi = lo + len(reference.tokens[i])
        assert f["checked"][lo:hi].all(), i
        mism = np.nonzero(f["mismatch"][lo:hi])[0]
        bad += [(i, p) for p in mism if reference.margins[i][p] >= TOL]
        assert res.tokens == reference.tokens[i]
    assert not bad
    assert 0 < len(cancelled) < n // 5


def test_stream_yields_the_result():
    cfg, params = tiny_model(seed=1)
    engine = ServingEngine(cfg, params, NgramDrafter(k=3), num_slots=2, slot_len=64, page_size=8)
    prompts = random_prompts(np.random.default_rng(3), 3, 8)
    rids = [engine.submit(p, 15) for p in prompts]
    streamed = list(engine.stream(rids[1]))
    engine.run()
    assert streamed == engine.results[rids[1]].tokens and len(streamed) == 15
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=15)).generate(prompts)
    assert [engine.results[r].tokens for r in rids] == reference.tokens


def test_bad_requests_get_clear_errors():
    cfg, params = tiny_model(seed=1)
    engine = ServingEngine(cfg, params, NgramDrafter(k=4), num_slots=2, slot_len=32, page_size=8,
                           max_waiting=2, prompt_width=16)
    with pytest.raises(ConfigError, match="slot_len=32"):
        engine.submit([1] * 10, 20)  # 10 + 20 + 5 > 32
    with pytest.raises(ConfigError, match="prompt_width=16"):
        engine.submit([1] * 17, 2)
    with pytest.raises(ConfigError, match="empty prompt"):
        engine.submit([], 2)
    with pytest.raises(ConfigError, match="outside"):
        engine.submit([1, cfg.vocab_size], 2)
    engine.submit([1, 2], 4)
    engine.submit([1, 2], 4)
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        engine.submit([1, 2], 4)
    with pytest.raises(ConfigError, match="two_level_k1"):
        ServingEngine(cfg, params, NgramDrafter(k=2), options=ServingOptions(two_level_k1=2))


def test_paged_attention_kernel_serves_exactly():
    """Verify steps through the ragged paged attention kernel (Pallas interpret mode), packed and
    budgeted with two-level verification: token forcing passes (pages of 8 positions: a kernel
    block spans several); a poisoned request fails alone; a page size the kernel cannot take is
    refused up front."""
    cfg, params = tiny_model(seed=4)
    rng = np.random.default_rng(9)
    prompts = random_prompts(rng, 4, 8, 3, 20)
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=12)).generate(prompts)
    opts = ServingOptions(packed=True, budget=4, steps_per_call=4, two_level_k1=1, attention="interpret")
    engine = ServingEngine(cfg, params, NgramDrafter(k=3), num_slots=2, slot_len=64, page_size=8,
                           options=opts, forcing=True)
    assert_forcing(engine, prompts, reference, 12)
    poison = cfg.vocab_size - 1
    bad_params = dataclasses.replace(params, embed=params.embed.at[poison].set(jnp.nan))
    engine = ServingEngine(cfg, bad_params, NgramDrafter(k=3), num_slots=2, slot_len=64, page_size=16,
                           options=opts)
    good, bad = engine.submit(prompts[0], 12), engine.submit([1, 2, poison, 3], 12)
    results = engine.run()
    assert results[bad].status == "failed" and results[good].tokens == reference.tokens[0]
    with pytest.raises(ConfigError, match="page_size a power of two"):
        ServingEngine(cfg, params, NgramDrafter(k=3), num_slots=2, slot_len=48, page_size=12, options=opts)


def test_admission_prefill_writes_the_decoders_prompt_kv():
    """The serving engine's admission (prompt width 125, inside its device loop) and the Decoder's
    shared prompt program (bucket 128) write the same K/V bits on our kernels, with SmolLM2's
    dimensions (where a RoPE whose float32 products an FMA could fuse differently per program
    gave one q element other bits, and 151+ K elements of later layers followed)."""
    from specjax.decoding.sequences import prompt_bucket, prompt_pass
    from specjax.serving.decoder import ServingDecoder
    cfg, params = tiny_model(seed=2, dtype="bfloat16", hidden_size=576, intermediate_size=1536, num_layers=3,
                             num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=512, scale=0.05)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 125).tolist()
    gen = GenerationConfig(max_new_tokens=2)
    dec = Decoder(cfg, params, gen, kernels="interpret")
    P = prompt_bucket(len(prompt))
    cache, _, _ = prompt_pass(dec.params, cfg, jnp.asarray([prompt + [0] * (P - len(prompt))], jnp.int32),
                              jnp.asarray([len(prompt)], jnp.int32))
    engine = ServingDecoder(cfg, params, gen, None, num_slots=1, kernels="interpret",
                            options=ServingOptions(steps_per_call=1)).engine([prompt])
    engine.submit(prompt, 1)
    engine.run()  # a fresh engine's first request holds pages 1, 2, ... in order
    ps, n = engine.page_size, -(-len(prompt) // engine.page_size)
    for layer in range(cfg.num_layers):
        for ref, pool in ((cache.k[layer], engine.state.cache.k[layer]), (cache.v[layer], engine.state.cache.v[layer])):
            got = pool[1:1 + n].reshape((n * ps,) + pool.shape[2:])[:len(prompt)]
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref[0, :len(prompt)], np.float32))


def test_cancel_and_failing_request_leave_others_exact():
    """A request cancelled mid-generation stops; one whose logits turn non-finite (a poisoned
    embedding row) fails with a message; the others still equal AR."""
    cfg, params = tiny_model(seed=2)
    poison = cfg.vocab_size - 1
    params = dataclasses.replace(params, embed=params.embed.at[poison].set(jnp.nan))
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 5, 8, 3, 10)
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=20)).generate(prompts)
    engine = ServingEngine(cfg, params, NgramDrafter(k=3), num_slots=3, slot_len=64, page_size=8,
                           options=ServingOptions(packed=True, budget=4))
    rids = [engine.submit(p, 20) for p in prompts[:3]]
    bad = engine.submit([1, 2, poison, 3], 20)
    engine.step()
    engine.step()
    engine.cancel(rids[1])
    rids += [engine.submit(p, 20) for p in prompts[3:]]
    results = engine.run()
    assert results[rids[1]].status == "cancelled"
    assert results[rids[1]].tokens == reference.tokens[1][:len(results[rids[1]].tokens)]
    assert len(results[rids[1]].tokens) < 20
    assert results[bad].status == "failed" and "non-finite" in results[bad].error
    for i in (0, 2, 3, 4):
        assert results[rids[i]].status == "finished"
        assert results[rids[i]].tokens == reference.tokens[i]


def test_serving_decoder_runs_the_pallas_gemms():
    """ServingDecoder(kernels=...) serves on our GEMM, norm and attention kernels (interpret mode
    here) as engine.Decoder does, chains and trees: token-exact against that engine's AR with no
    near-tie allowance (the same kernels round every row alike)."""
    from specjax.forcing import check_token_forcing
    from specjax.serving.decoder import ServingDecoder
    cfg, params = tiny_model(seed=2, dtype="bfloat16")
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, 3, 8)
    gen = GenerationConfig(max_new_tokens=10)
    reference = Decoder(cfg, params, gen, kernels="interpret").generate(prompts)
    from specjax.trees.builders import TreeSpec
    for opts in (ServingOptions(packed=True), ServingOptions(budget=4, tree=TreeSpec("topk", 5, 3)),
                 ServingOptions(packed=True, two_level_k1=2, tree=TreeSpec("topk", 5, 3))):
        dec = ServingDecoder(cfg, params, gen, NgramDrafter(k=3, vocab_size=cfg.vocab_size), num_slots=2,
                             options=opts, kernels="interpret")
        assert type(dec.params.layers[0].w_qkv).__name__ == "GemmWeight"
        report = check_token_forcing(dec, prompts, reference, tolerance=0.0)
        assert report.passed and not report.failures, report.summary()
