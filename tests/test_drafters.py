"""Drafters in isolation: n-gram lookup picks the right continuation; layer-skip shares weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from specjax.decoding.sequences import Sequences
from specjax.drafters.model_drafter import layer_skip_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import ConfigError
from specjax.sampling import SamplingConfig


def seqs_of(rows, S=32):
    tokens = np.zeros((len(rows), S), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    n = len(rows)
    return Sequences(tokens=jnp.asarray(tokens), length=jnp.asarray([len(r) for r in rows], jnp.int32),
                     prompt_len=jnp.ones(n, jnp.int32), done=jnp.zeros(n, bool),
                     margins=jnp.zeros((n, S), jnp.float32))


def propose(drafter, rows):
    draft, q, _ = drafter.propose((), seqs_of(rows), jax.random.PRNGKey(0), SamplingConfig())
    assert q is None
    return np.asarray(draft).tolist()


def test_ngram_prefers_longest_then_most_recent_match():
    d = NgramDrafter(k=3, max_n=3)
    # last 3 tokens (7, 8, 9) occurred at index 0 followed by 1, 2, 3
    assert propose(d, [[7, 8, 9, 1, 2, 3, 5, 7, 8, 9]]) == [[1, 2, 3]]
    # only the last token (9) recurs: the most recent earlier 9 is followed by 4, 4
    assert propose(d, [[9, 1, 1, 9, 4, 4, 6, 9]])[0][:2] == [4, 4]


def test_ngram_without_match_repeats_pending_token():
    assert propose(NgramDrafter(k=2), [[1, 2, 3, 4]]) == [[4, 4]]


def test_ngram_rows_are_independent():
    d = NgramDrafter(k=2, max_n=2)
    out = propose(d, [[5, 6, 1, 5, 6], [3, 3, 3]])
    assert out[0] == [1, 5] and out[1][0] == 3  # (3, 3) at 0 is followed by 3; then scratch


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ConfigError):
        NgramDrafter(k=0)
    with pytest.raises(ConfigError):
        NgramDrafter(k=2, max_n=1, min_n=2)


def test_layer_skip_shares_the_target_arrays():
    cfg, params = tiny_model()
    d = layer_skip_drafter(params, cfg, 2, k=3)
    assert d.cfg.num_layers == 2 and len(d.params.layers) == 2
    assert d.params.embed is params.embed and d.params.layers[1] is params.layers[1]
    with pytest.raises(ConfigError, match="layerskip"):
        layer_skip_drafter(params, cfg, 0, k=3)


def test_pooled_tau_counts_rounds_not_prompts():
    """A prompt that ends before its first verify round has no τ of its own: pooling rounds keeps
    it from dragging the mean below 1 (a per-prompt mean would count it as 0)."""
    from specjax.engine import GenerationResult, pooled_tau

    def result(hist):
        return GenerationResult(tokens=[[1]], margins=[[0.0]], prefill_s=0.0, decode_s=0.0, compile_s=0.0,
                                steps=0, accepted_hist=np.asarray([hist]))
    busy, idle = result([1, 0, 3]), result([0, 0, 0])  # 4 rounds: 1 + 3 * 3 tokens
    assert pooled_tau([busy, idle]) == pytest.approx(10 / 4) == busy.tau
    assert idle.tau == 1.0 and pooled_tau([]) == 1.0
