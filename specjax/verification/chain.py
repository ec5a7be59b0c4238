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


def draft_limit(k: int, num_drafts: jax.Array | None) -> jax.Array:
    """[B, k] or [1, k] bool: which draft positions were verified (all of them without a limit)."""
    if num_drafts is None:
        return jnp.ones((1, k), bool)
    return jnp.arange(k)[None, :] < num_drafts[:, None]


def greedy_accept(draft: jax.Array, target_logits: jax.Array, num_drafts: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """draft [B, k], target_logits [B, k+1, V]: accept the longest prefix equal to the target argmax.
    num_drafts [B] (batched serving): only the first num_drafts[b] drafts were verified."""
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    num_accepted = leading_true((draft == target[:, :-1]) & draft_limit(draft.shape[1], num_drafts))
    return num_accepted, target  # accepted drafts equal the argmax, so `target` is the output row


def acceptance_tests(draft, draft_probs, target_probs, key) -> jax.Array:
    """[B, k] bool: draft i passes u_i q_i(d_i) < p_i(d_i), with the step's uniforms drawn from
    `key` for all k positions at once, so a caller that looks at the first few positions first
    (two-level verification) sees the same draws as the full rule."""
    B, k = draft.shape
    p_draft = jnp.take_along_axis(target_probs[:, :k], draft[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, draft[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(jax.random.split(key)[0], (B, k))
    return u * q_draft < p_draft  # u < p/q without dividing; q(d) > 0 since d was drawn from q


def rejection_accept(draft: jax.Array, draft_probs: jax.Array | None, target_probs: jax.Array,
                     key: jax.Array, num_drafts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft [B, k] drawn from draft_probs q [B, k, V] (None: deterministic drafts, q is one-hot),
    target_probs p [B, k+1, V]. Draft i is accepted with probability min(1, p_i(d)/q_i(d)); at the first
    rejection the token is drawn from normalize(max(p_i - q_i, 0)); if all k pass, from p_k. The
    output then follows p exactly, whatever q is. num_drafts [B]: only the first num_drafts[b]
    drafts were verified; after accepting all of them the token is drawn from p at that position.
    """
    B, k = draft.shape
    onehot = jax.nn.one_hot(draft, target_probs.shape[-1], dtype=target_probs.dtype)
    q = onehot if draft_probs is None else draft_probs
    accepted = acceptance_tests(draft, draft_probs, target_probs, key) & draft_limit(k, num_drafts)
    num_accepted = leading_true(accepted)

    residual = jnp.maximum(target_probs[:, :k] - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only when p_i == q_i, where rejection has probability 0; keep p_i to stay finite.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), target_probs[:, :k])
    fallback = jnp.concatenate([residual, target_probs[:, k:]], axis=1)  # [B, k+1, V]
    if num_drafts is not None:  # past the verified drafts there was no rejection: draw from p
        past = jnp.arange(k + 1)[None, :] >= num_drafts[:, None]
        fallback = jnp.where(past[..., None], target_probs, fallback)
    chosen = jnp.take_along_axis(fallback, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    next_token = sample_from(chosen, jax.random.split(key)[1])
    out = jnp.concatenate([draft, jnp.zeros((B, 1), jnp.int32)], axis=1)
    out = out.at[jnp.arange(B), num_accepted].set(next_token)
    return num_accepted, out
