"""Temperature and top-p against a direct numpy computation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.errors import ConfigError
from specjax.sampling import SamplingConfig, probabilities, top2_margin


def numpy_top_p(logits, temperature, top_p):
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for i in order:
        keep[i] = True
        mass += p[i]
        if mass >= top_p:
            break
    q = np.where(keep, p, 0)
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (1.0, 0.05)])
def test_probabilities_match_numpy(rng, temperature, top_p):
    logits = rng.normal(size=(5, 50)).astype(np.float32) * 3
    got = np.asarray(probabilities(jnp.asarray(logits), SamplingConfig(temperature, top_p)))
    for row, g in zip(logits, got):
        np.testing.assert_allclose(g, numpy_top_p(row.astype(np.float64), temperature, top_p), atol=1e-5)


def test_top2_margin():
    x = jnp.array([[1.0, 5.0, 3.0], [2.0, 2.0, 0.0]])
    assert np.allclose(top2_margin(x), [2.0, 0.0])


def test_bad_values():
    with pytest.raises(ConfigError):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ConfigError):
        SamplingConfig(top_p=1.5)
