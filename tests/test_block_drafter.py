"""Block-parallel drafter: greedy output equals AR on random targets and on SmolLM2 (untrained
drafters: acceptance is low, exactness must hold regardless), the context it reads is the target's,
and bad configurations are refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import draw_model_config, humaneval_prompts, tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.block import attach, default_taps, init_block_drafter
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.forcing import check_token_forcing
from specjax.models.params import init_random_params

TOL = 1e-3


def assert_chain_equals_ar(cfg, params, drafter, prompts, gen):
    reference = Decoder(cfg, params, gen).generate(prompts)
    decoder = Decoder(cfg, params, gen, drafter)
    report = check_token_forcing(decoder, prompts, reference, tolerance=TOL)
    assert report.passed, report.summary() + "\n" + "\n".join(map(str, report.failures[:10]))
    free = decoder.generate(prompts)
    if all(min(m, default=np.inf) >= TOL for m in reference.margins):
        assert free.tokens == reference.tokens
    return free


@st.composite
def random_case(draw):
    cfg = draw_model_config(draw)
    taps = draw(st.lists(st.integers(0, cfg.num_layers - 1), min_size=1, max_size=3, unique=True))
    batch = draw(st.integers(1, 3))
    prompts = [draw(st.lists(st.integers(0, cfg.vocab_size - 1), min_size=1, max_size=30))
               for _ in range(batch)]
    return dict(cfg=cfg, taps=taps, prompts=prompts, seed=draw(st.integers(0, 2**16)),
                block=draw(st.integers(2, 9)), layers=draw(st.integers(1, 2)), conv=draw(st.booleans()),
                max_new=draw(st.integers(1, 24)))


@settings(max_examples=7, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_case())
def test_random_targets_block_drafter_equals_ar(case):
    cfg = case["cfg"]
    params = init_random_params(cfg, jax.random.PRNGKey(case["seed"]), scale=0.5)
    drafter = init_block_drafter(params, cfg, jax.random.PRNGKey(case["seed"] + 1), case["block"],
                                 case["layers"], case["taps"], case["conv"], scale=0.5)
    assert drafter.k == case["block"] - 1
    assert_chain_equals_ar(cfg, params, drafter, case["prompts"], GenerationConfig(max_new_tokens=case["max_new"]))


def test_drafter_reads_the_target_context_it_was_given():
    """Swapping the tapped features for zeros changes the drafts: the context is really read."""
    cfg, params = tiny_model(seed=11)
    drafter = init_block_drafter(params, cfg, jax.random.PRNGKey(2), 6, 2, [0, 1], scale=0.5)
    prompt = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    from specjax.decoding.sequences import prefill
    gen = GenerationConfig(max_new_tokens=8)
    cache, seqs, _, feats = prefill(params, cfg, gen, prompt, jnp.array([8]), 32, jax.random.PRNGKey(0),
                                    drafter.taps)
    assert feats.shape == (1, 8, 2 * cfg.hidden_size)
    real = drafter.block_logits(drafter.init(prompt, jnp.array([8]), 32, features=feats), seqs)
    blank = drafter.block_logits(drafter.init(prompt, jnp.array([8]), 32, features=jnp.zeros_like(feats)), seqs)
    assert real.shape == (1, 5, cfg.vocab_size)
    assert not np.allclose(np.asarray(real), np.asarray(blank))
    # context past the pending slot is never read: garbage written there changes nothing
    state = drafter.init(prompt, jnp.array([8]), 32, features=feats)
    junk = drafter.observe(state, 100.0 * jnp.ones((1, 4, 2 * cfg.hidden_size), feats.dtype), seqs.length)
    np.testing.assert_array_equal(np.asarray(drafter.block_logits(junk, seqs)), np.asarray(real))


def test_smollm2_block_drafter_equals_ar(smollm2):
    prompts = [smollm2.tokenizer.encode(p) for p in humaneval_prompts()[4:6]]
    gen = GenerationConfig(max_new_tokens=24, stop_tokens=smollm2.tokenizer.eos_ids)
    drafter = init_block_drafter(smollm2.params, smollm2.cfg, jax.random.PRNGKey(0), 8, 1,
                                 default_taps(smollm2.cfg), conv=True)
    free = assert_chain_equals_ar(smollm2.cfg, smollm2.params, drafter, prompts, gen)
    assert free.tau >= 1.0


def test_bad_configurations_are_refused():
    cfg, params = tiny_model(seed=1)  # 2 layers
    key = jax.random.PRNGKey(0)
    with pytest.raises(ConfigError, match="tapped layers"):
        init_block_drafter(params, cfg, key, 4, 1, [cfg.num_layers])
    with pytest.raises(ConfigError, match="tapped layers"):
        init_block_drafter(params, cfg, key, 4, 1, [0, 0])
    with pytest.raises(ConfigError, match="must not be empty"):
        init_block_drafter(params, cfg, key, 4, 1, [])
    with pytest.raises(ConfigError, match="block_size"):
        init_block_drafter(params, cfg, key, 1, 1, [0])
    good = init_block_drafter(params, cfg, key, 4, 1, [0, 1])
    wide_cfg, wide = tiny_model(seed=2, hidden_size=48)
    with pytest.raises(ConfigError, match="hidden size 48"):
        attach(good.params, wide, wide_cfg, [0, 1], 4)
    assert attach(good.params, params, cfg, [0, 1], 4).k == 3
    assert default_taps(dataclasses.replace(cfg, num_layers=30)) == (1, 14, 28)
