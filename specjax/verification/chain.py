"""Chain verification: given k drafted tokens and the target's k+1 distributions, decide how many
drafts to accept and which token follows them. Runs on the device; the host never reads logits.

Both rules return (num_accepted [B] in 0..k, out [B, k+1]) where out[:, :num_accepted] are the accepted
drafts and out[:, num_accepted] is the target's own next token (the "bonus" token, or a draw from the
residual distribution after a rejection). Entries past num_accepted are meaningless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import sample_from


def leading_true(x: jax.Array) -> jax.Array:
    """[B, k] bool -> [B] count of leading True values."""
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy_accept(draft: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft [B, k], target_logits [B, k+1, V]: accept the longest prefix equal to the target argmax."""
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    num_accepted = leading_true(draft == target[:, :-1])
    return num_accepted, target  # accepted drafts equal the argmax, so `target` is the output row


def rejection_accept(draft: jax.Array, draft_probs: jax.Array | None, target_probs: jax.Array,
                     key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft [B, k] drawn from draft_probs q [B, k, V] (None: deterministic drafts, q is one-hot),
    target_probs p [B, k+1, V]. Draft i is accepted with probability min(1, p_i(d)/q_i(d)); at the first
    rejection the token is drawn from normalize(max(p_i - q_i, 0)); if all k pass, from p_k. The
    output then follows p exactly, whatever q is.
    """
    B, k = draft.shape
    p_draft = jnp.take_along_axis(target_probs[:, :k], draft[..., None], axis=-1)[..., 0]
    onehot = jax.nn.one_hot(draft, target_probs.shape[-1], dtype=target_probs.dtype)
    q = onehot if draft_probs is None else draft_probs
    q_draft = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    key_u, key_s = jax.random.split(key)
    u = jax.random.uniform(key_u, (B, k))
    accepted = u * q_draft < p_draft  # u < p/q without dividing; q(d) > 0 since d was drawn from q
    num_accepted = leading_true(accepted)

    residual = jnp.maximum(target_probs[:, :k] - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only when p_i == q_i, where rejection has probability 0; keep p_i to stay finite.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), target_probs[:, :k])
    fallback = jnp.concatenate([residual, target_probs[:, k:]], axis=1)  # [B, k+1, V]
    chosen = jnp.take_along_axis(fallback, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    next_token = sample_from(chosen, key_s)
    out = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    out = out.at[jnp.arange(B), num_accepted].set(next_token)
    return num_accepted, out
