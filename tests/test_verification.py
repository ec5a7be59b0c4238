"""Acceptance rules on hand-made inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.verification.chain import greedy_accept, leading_true, rejection_accept


def test_leading_true():
    x = jnp.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], bool)
    assert leading_true(x).tolist() == [2, 0, 4]


def test_greedy_accept_longest_prefix_and_bonus():
    V = 5
    target = np.array([[3, 1, 4, 0], [2, 2, 2, 2]])  # argmax per position
    logits = jax.nn.one_hot(target, V) * 10.0
    draft = jnp.array([[3, 1, 2], [2, 2, 2]])
    n, out = greedy_accept(draft, logits)
    assert n.tolist() == [2, 3]
    assert out[0, :3].tolist() == [3, 1, 4]  # two accepted drafts, then the target's token
    assert out[1].tolist() == [2, 2, 2, 2]  # all accepted plus the bonus


def test_rejection_accepts_everything_when_q_equals_p():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=(64, 4)).astype(np.float32)
    draft = jnp.asarray(np.array([[rng.choice(7, p=p[b, i]) for i in range(3)] for b in range(64)]))
    n, _ = rejection_accept(draft, jnp.asarray(p[:, :3]), jnp.asarray(p), jax.random.PRNGKey(0))
    assert n.tolist() == [3] * 64


def test_rejection_never_accepts_zero_probability_drafts():
    p = np.zeros((8, 3, 4), np.float32)
    p[..., 0] = 1.0  # the target only ever says token 0
    draft = jnp.full((8, 2), 2, jnp.int32)
    n, out = rejection_accept(draft, None, jnp.asarray(p), jax.random.PRNGKey(1))
    assert n.tolist() == [0] * 8
    assert out[:, 0].tolist() == [0] * 8  # the residual puts all mass on token 0


def test_one_hot_rejection_probability_is_target_probability():
    """A deterministic draft d is accepted with probability p(d)."""
    p = np.array([0.3, 0.7], np.float32)
    target = jnp.asarray(np.broadcast_to(p, (20000, 2, 2)))
    draft = jnp.zeros((20000, 1), jnp.int32)
    n, out = rejection_accept(draft, None, target, jax.random.PRNGKey(2))
    rate = float(jnp.mean(n))
    assert abs(rate - 0.3) < 0.015
    rejected = np.asarray(n) == 0
    assert np.all(np.asarray(out)[rejected, 0] == 1)  # residual of one-hot(0) under p is token 1
