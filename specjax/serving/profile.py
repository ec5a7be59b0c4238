"""The calibration microbenchmark for budgeted verification: measured seconds of one packed
verify pass (the flat forward and its logits) at several token counts, for `choose_budget`.

The batch's slots each hold `slot_len / 2` committed positions; the T tokens are spread evenly
over them. Each count runs `reps` dependent passes inside one jit (the cache threads through),
after a warm-up, so host dispatch is paid once per count, not per pass.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.target import target_logits
from specjax.serving.budget import layout
from specjax.serving.flat_forward import flat_forward
from specjax.serving.paged_cache import init_paged_cache
from specjax.rounding import exact_jit


def verify_profile(params, cfg, batch: int, slot_len: int, token_counts, page_size: int = 16,
                   reps: int = 5) -> dict[int, float]:
    """-> {T: seconds of one verify pass over T tokens from `batch` slots}."""
    pages_per_slot = slot_len // page_size
    cache = init_paged_cache(cfg, 1 + batch * pages_per_slot, page_size)
    pages = (1 + jnp.arange(batch * pages_per_slot, dtype=jnp.int32)).reshape(batch, pages_per_slot)
    first = jnp.full(batch, slot_len // 2, jnp.int32)
    out = {}
    for T in token_counts:
        width = max(1, -(-T // batch))
        counts = jnp.asarray(np.minimum(width, np.maximum(T - np.arange(batch) * width, 0)), jnp.int32)
        table = jnp.ones((batch, width), jnp.int32)

        # the weights are an argument: closed over, jit would embed them as constants (for an 8B
        # target 16 GB of them, and a compile that never ends; docs/notes/perf.md)
        @exact_jit
        def passes(params, cache, counts=counts, table=table, T=T, width=width):
            def body(_, carry):
                cache, acc = carry
                batch_ = layout(table, first, 0, width, counts, True, T)
                hidden, _, cache = flat_forward(params, cfg, batch_, pages, cache)
                return cache, acc + target_logits(params, cfg, hidden[:1])[0, 0]
            return jax.lax.fori_loop(0, reps, body, (cache, jnp.float32(0)))

        jax.block_until_ready(passes(params, cache))  # compile + warm up
        t = time.perf_counter()
        cache, _ = jax.block_until_ready(passes(params, cache))
        out[int(T)] = (time.perf_counter() - t) / reps
    return out


def interpolate(profile: dict[int, float]):
    """A profile -> seconds(T), linear between measured counts, flat past the ends."""
    xs = np.array(sorted(profile), np.float64)
    ys = np.array([profile[int(x)] for x in xs])
    return lambda tokens: float(np.interp(tokens, xs, ys))
