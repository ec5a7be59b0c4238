"""Acceptance replay: the realized acceptance reproduces the recorded profile (10^4 rounds, within
2%), the output stays AR's, the inner network really runs, and bad profiles are refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_model
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.block import init_block_drafter
from specjax.drafters.replay import LABEL, load_profile, profile_from_hist, replay_drafter, save_profile
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.forcing import check_token_forcing
from specjax.sampling import SamplingConfig


def test_profile_round_trip_and_from_histogram(tmp_path):
    hist = np.array([[10, 20, 30, 40]])  # rounds with 0, 1, 2, 3 accepted
    alpha = profile_from_hist(hist)
    np.testing.assert_allclose(alpha, [90 / 100, 70 / 90, 40 / 70])
    save_profile(tmp_path / "p.json", alpha, {"target": "t", "drafter": "d"})
    assert load_profile(tmp_path / "p.json") == pytest.approx(alpha)
    (tmp_path / "bad.json").write_text('{"checksum": "x", "payload": {"alpha": [1.5]}}')
    with pytest.raises(Exception, match="checksum"):
        load_profile(tmp_path / "bad.json")


def test_replay_reproduces_the_profile_and_stays_exact():
    cfg, params = tiny_model(seed=6, scale=0.4)
    alpha = [0.85, 0.7, 0.5, 0.3]
    inner = init_block_drafter(params, cfg, jax.random.PRNGKey(0), len(alpha) + 1, 1, [0])
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, rng.integers(2, 8))] for _ in range(84)]
    max_new = 360
    drafter = replay_drafter(inner, cfg, params, prompts, max_new, alpha)
    assert drafter.label == LABEL
    gen = GenerationConfig(max_new_tokens=max_new)
    out = Decoder(cfg, params, gen, drafter).generate(prompts)
    ref = Decoder(cfg, params, gen).generate(prompts)
    assert out.tokens == ref.tokens
    hist = out.accepted_hist.sum(axis=0)
    assert hist.sum() >= 10_000
    expected = np.array([np.prod(alpha[:j]) * (1 - (alpha[j] if j < len(alpha) else 0))
                         for j in range(len(alpha) + 1)])
    np.testing.assert_allclose(hist / hist.sum(), expected, atol=0.02)
    np.testing.assert_allclose(profile_from_hist(hist), alpha, atol=0.02)
    small = replay_drafter(inner, cfg, params, prompts[:4], 40, alpha)
    gen40 = GenerationConfig(max_new_tokens=40)
    report = check_token_forcing(Decoder(cfg, params, gen40, small), prompts[:4],
                                 Decoder(cfg, params, gen40).generate(prompts[:4]), tolerance=1e-3)
    assert report.passed, report.summary()


def test_inner_network_runs_and_bad_input_is_refused():
    cfg, params = tiny_model(seed=2)
    inner = init_block_drafter(params, cfg, jax.random.PRNGKey(0), 3, 1, [1])
    with pytest.raises(ConfigError, match="3 positions, the drafter proposes 2"):
        replay_drafter(inner, cfg, params, [[1, 2]], 8, [0.5, 0.5, 0.5])
    with pytest.raises(ConfigError, match="probabilities"):
        replay_drafter(inner, cfg, params, [[1, 2]], 8, [0.5, 1.5])
    drafter = replay_drafter(inner, cfg, params, [[1, 2, 3]], 8, [0.9, 0.9])
    hlo = jax.jit(lambda d, st, s, k: d.propose(st, s, k, SamplingConfig())).lower(
        drafter, *_state_and_seqs(drafter, cfg, params)).as_text()
    assert "optimization_barrier" in hlo and hlo.count("dot_general") >= 4  # the inner layer's GEMMs
    with pytest.raises(NotImplementedError, match="greedy"):
        Decoder(cfg, params, GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=1.0)),
                drafter).generate([[1, 2, 3]])


def _state_and_seqs(drafter, cfg, params):
    import jax.numpy as jnp

    from specjax.decoding.sequences import prefill
    prompt = jnp.asarray([[1, 2, 3]], jnp.int32)
    cache, seqs, _, feats = prefill(params, cfg, GenerationConfig(max_new_tokens=8), prompt, jnp.array([3]),
                                    64, jax.random.PRNGKey(0), drafter.taps)
    return drafter.init(prompt, jnp.array([3]), 64, features=feats), seqs, jax.random.PRNGKey(1)
