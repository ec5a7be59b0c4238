"""One interface over the two target families, so every decode loop serves both: dense
(`transformer.py`, a KV cache only) and hybrid recurrent (`hybrid.py`, KV cache + GDN state).

- `target_forward`: T tokens in order (prefill, AR steps); `valid` [B] counts each row's real
  tokens (right-padding past it never reaches a recurrent state).
- `target_verify`: the N nodes of a tree (a chain is a tree) in one forward; a hybrid target's GDN
  layers do not advance over them, and `pending` holds the nodes' tokens and GDN inputs
  (`VerifiedNodes`).
- `target_commit`: after acceptance, the accepted path becomes the committed prefix: dense K/V move
  to contiguous slots (trees only); a hybrid target defers the path (its tokens, no state) to the
  next forward, which replays it into the GDN states first (docs/design/hybrid.md).
- `with_replay_width` before a decode loop (the cache's shape must not change inside it), and
  `target_settle` to bring the GDN states up to date with everything committed.

The family is chosen by the config's type at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.hybrid import hybrid_logits, hybrid_run, init_hybrid_cache
from specjax.models.hybrid_config import HybridConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import dense_mask, forward_with_taps, lm_logits


def is_hybrid(cfg) -> bool:
    return isinstance(cfg, HybridConfig)


def init_target_cache(cfg, batch: int, num_slots: int):
    return init_hybrid_cache(cfg, batch, num_slots) if is_hybrid(cfg) else init_cache(cfg, batch, num_slots)


def target_logits(params, cfg, hidden: jax.Array) -> jax.Array:
    return hybrid_logits(params, hidden) if is_hybrid(cfg) else lm_logits(params, hidden)


def target_forward(params, cfg, tokens, positions, cache, start, taps: tuple[int, ...] = (),
                   mask=None, valid=None):
    """-> (final-normed hidden [B, T, D], tapped features or None, new cache)."""
    if is_hybrid(cfg):
        hidden, features, cache, _ = hybrid_run(params, cfg, tokens, positions, cache, start, mask,
                                                    valid=valid, taps=taps)
        return hidden, features, cache
    return forward_with_taps(params, cfg, tokens, positions, cache, start, taps, mask)


def chain_ancestors(batch: int, n: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch, n, n))


def target_verify(params, cfg, tokens, positions, cache, start, taps, mask, parents, ancestors, depth: int,
                  pack=None, prefix=None):
    """The N nodes (node 0: the pending token) under `mask` [B, N, S] (attention) with the tree's
    parents [B, N], ancestors [B, N, N] and static depth (GDN layers)
    -> (hidden, features, cache, pending). pack: (counts [B], bucket), hybrid targets only: verify
    each row's first counts[b] nodes packed into one bucket (`hybrid_run`). prefix: the pending of
    a verify of the tree's first nodes (hybrid targets only): tokens/positions/start are then the
    later nodes', mask/parents/ancestors the whole tree's (`hybrid_run`)."""
    if is_hybrid(cfg):  # its attention layers take the dense mask (replayed rows come first)
        mask = None if mask is None else dense_mask(mask)[:, -tokens.shape[1]:]
        return hybrid_run(params, cfg, tokens, positions, cache, start, mask, taps=taps,
                          tree=(parents, ancestors, depth), pack=pack, prefix=prefix)
    if pack is not None or prefix is not None:
        raise ValueError("packed and two-level verification here are for hybrid targets; dense targets "
                         "pack in serving/flat_forward.py")
    hidden, features, cache = forward_with_taps(params, cfg, tokens, positions, cache, start, taps, mask)
    return hidden, features, cache, None


def chain_verify(params, cfg, tokens, positions, cache, start, taps, pack=None, prefix=None):
    """`target_verify` for a chain of T = tokens.shape[1] nodes (causal mask), or for its later
    T nodes after a verify of the first ones (`prefix`, hybrid targets; start: the first later
    node's slot)."""
    B, T = tokens.shape
    N = T + (0 if prefix is None else prefix.tokens.shape[1])
    parents = jnp.broadcast_to(jnp.arange(-1, N - 1, dtype=jnp.int32), (B, N))
    return target_verify(params, cfg, tokens, positions, cache, start, taps, None, parents,
                         chain_ancestors(B, N), N - 1, pack, prefix)


def move_kv(k: list, v: list, path: jax.Array, start: jax.Array, pages: jax.Array | None = None
            ) -> tuple[list, list]:
    """Move the accepted path's K/V from slots start + path[d] to start + d (d = 0..D). pages: the
    buffers are page pools read through this block table (a hybrid cache's paged form)."""
    src = start[:, None] + path  # [B, D+1]
    dst = start[:, None] + jnp.arange(path.shape[1])[None, :]
    rows = jnp.arange(path.shape[0])[:, None]

    def move(buf):
        if pages is None:
            return buf.at[rows, dst].set(buf[rows, src])
        from specjax.models.hybrid import paged_rows
        flat = buf.reshape((-1,) + buf.shape[2:])
        return flat.at[paged_rows(buf, pages, dst)].set(flat[paged_rows(buf, pages, src)],
                                                        mode="drop").reshape(buf.shape)
    return [move(x) for x in k], [move(x) for x in v]


def target_commit(params, cfg, cache, pending, path: jax.Array, num_accepted: jax.Array, start: jax.Array,
                  is_chain: bool = False):
    """Make path[:, :num_accepted + 1] the committed prefix (path [B, D + 1] node indices, root
    first). A chain's nodes already sit in their slots (`is_chain`: no K/V move)."""
    if is_hybrid(cfg):
        k, v = (cache.k, cache.v) if is_chain else move_kv(cache.k, cache.v, path, start, cache.pages)
        if cache.replay.shape[1] != path.shape[1]:
            raise ValueError(f"the cache defers paths of {cache.replay.shape[1]} tokens, this step's are "
                             f"{path.shape[1]}: call with_replay_width(cfg, cache, {path.shape[1]}) first")
        return cache.replaced(k=k, v=v, replay=jnp.take_along_axis(pending.tokens, path, axis=1).astype(jnp.int32),
                              replay_len=(num_accepted + 1).astype(jnp.int32), replay_start=start.astype(jnp.int32))
    if is_chain:
        return cache
    k, v = move_kv(cache.k, cache.v, path, start)
    return KVCache(k=k, v=v)


def target_settle(params, cfg, cache):
    """The cache with a hybrid target's deferred path replayed into its GDN states (a forward of
    that path alone); a dense cache, or one with nothing deferred, as it is."""
    if not is_hybrid(cfg) or cache.replay.shape[1] == 0:
        return cache
    B = cache.replay.shape[0]
    empty = jnp.zeros((B, 0), jnp.int32)
    start = cache.replay_start + cache.replay_len
    return hybrid_run(params, cfg, empty, empty, cache, start)[2]


def with_replay_width(params, cfg, cache, width: int):
    """A hybrid cache that defers paths of `width` tokens (static; a decode loop's carry must keep its
    shape): a pending path of another width is settled first. Dense caches pass through."""
    if not is_hybrid(cfg) or cache.replay.shape[1] == width:
        return cache
    cache = target_settle(params, cfg, cache)
    B = cache.replay.shape[0]
    return cache.replaced(replay=jnp.zeros((B, width), jnp.int32), replay_len=jnp.zeros((B,), jnp.int32))


def chain_path(batch: int, n: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))


__all__ = ["is_hybrid", "init_target_cache", "target_logits", "target_forward", "target_verify",
           "chain_verify", "target_commit", "target_settle", "with_replay_width", "chain_path", "move_kv"]
