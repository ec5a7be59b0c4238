"""Acceptance replay: benchmark a large random-weight target at a realistic acceptance rate.

A random target has no drafter that agrees with it, so its speculative speed would be measured at
~zero acceptance. The replay drafter runs a real drafter network of the configured size (its time
is real; its output is computed and then set aside) and proposes the target's own greedy AR
continuation, corrupted at the first position where a draw fails that position's recorded
conditional acceptance rate. The target still verifies every draft, so the output equals AR
decoding token for token; only the acceptance is borrowed, from a profile recorded on a real
(target, drafter) pair on real prompts. Everything it produces is labeled "replayed acceptance".
Greedy decoding only: the reference continuation is the greedy one.

It holds the continuations of a whole prompt set and finds each batch row's own by matching the
row's prompt at `init` (inside the jit), so one drafter serves every batch drawn from the set (the
search measures a deployment batch by batch). A prompt outside the set gets drafts that are all
rejected: the output stays exact, only its acceptance is zero.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.atomic import read_json_checked, write_json_atomic
from specjax.decoding.sequences import Sequences
from specjax.errors import ConfigError
from specjax.models.kv_cache import read_rows
from specjax.sampling import SamplingConfig
from specjax.verification.chain import leading_true

LABEL = "replayed acceptance"


def profile_from_hist(hist) -> list[float]:
    """Rounds by number of accepted drafts [k + 1] -> conditional acceptance of draft i given
    drafts 1..i-1 accepted, i = 1..k (a position never reached gets 0)."""
    hist = np.asarray(hist, np.float64).reshape(-1, np.shape(hist)[-1]).sum(axis=0)
    at_least = np.cumsum(hist[::-1])[::-1]  # rounds with >= i accepted, i = 0..k
    return [float(at_least[i] / at_least[i - 1]) if at_least[i - 1] else 0.0 for i in range(1, len(hist))]


def save_profile(path: str | Path, alpha: list[float], source: dict) -> None:
    write_json_atomic(path, {"alpha": [float(a) for a in alpha], "source": source})


def load_profile(path: str | Path) -> list[float]:
    alpha = read_json_checked(path).get("alpha")
    if not isinstance(alpha, list) or not alpha or not all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in alpha):
        raise ConfigError(f"{path}: field 'alpha' must be a non-empty list of probabilities in [0, 1]")
    return [float(a) for a in alpha]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayDrafter:
    inner: object  # the drafter network whose cost is measured (any drafter pytree)
    refs: jax.Array  # [N, R] prompt + the target's greedy AR continuation, per prompt, zero-padded
    ref_prompt_len: jax.Array  # [N] prompt lengths (what a row's prompt is matched against)
    alpha: jax.Array  # [k] conditional acceptance per draft position
    vocab_size: int = dataclasses.field(metadata=dict(static=True))
    label: str = dataclasses.field(default=LABEL, metadata=dict(static=True))

    @property
    def k(self) -> int:
        return self.inner.k

    @property
    def taps(self) -> tuple[int, ...]:
        return getattr(self.inner, "taps", ())

    def init(self, prompt, prompt_len, num_slots, features=None):
        """-> (inner state, [B] row of each prompt in `refs`, -1 where the prompt is not in the set)."""
        if self.taps:
            inner = self.inner.init(prompt, prompt_len, num_slots, features=features)
        else:
            inner = self.inner.init(prompt, prompt_len, num_slots)
        p = prompt.shape[1]
        refs = self.refs if self.refs.shape[1] >= p else jnp.pad(self.refs, ((0, 0), (0, p - self.refs.shape[1])))
        past = jnp.arange(p)[None, None, :] >= prompt_len[:, None, None]  # [B, 1, P]
        same = jnp.all((refs[None, :, :p] == prompt[:, None, :]) | past, axis=-1)  # [B, N]
        same &= self.ref_prompt_len[None, :] == prompt_len[:, None]
        rows = jnp.where(jnp.any(same, axis=1), jnp.argmax(same, axis=1), -1)
        return inner, rows

    def observe(self, state, features, start):
        inner, rows = state
        return self.inner.observe(inner, features, start), rows

    def propose(self, state, seqs: Sequences, key, sampling: SamplingConfig):
        if not sampling.greedy:
            raise NotImplementedError("acceptance replay replays the greedy continuation; sampled "
                                      "decoding has no single reference to replay")
        inner, rows = state
        k_inner, k_draw = jax.random.split(key)
        inner_draft, _, inner = self.inner.propose(inner, seqs, k_inner, sampling)
        # what the target will choose next (an unknown prompt's row reads row 0, never accepted)
        ref = read_rows(self.refs[jnp.maximum(rows, 0)], seqs.length, self.k)
        ok = (jax.random.uniform(k_draw, ref.shape) < self.alpha[None, :]) & (rows[:, None] >= 0)
        first_bad = leading_true(ok)  # drafts before it are accepted, it is rejected
        wrong = (ref + 1) % self.vocab_size
        draft = jnp.where(jnp.arange(self.k)[None, :] == first_bad[:, None], wrong, ref)
        # keep the inner network's work in the program: XLA would drop an unused result
        draft, _ = jax.lax.optimization_barrier((draft, inner_draft))
        return draft, None, (inner, rows)


def replay_drafter(inner, target_cfg, target_params, prompts: list[list[int]], max_new_tokens: int,
                   alpha: list[float]) -> ReplayDrafter:
    """A replay drafter for this prompt set (any batch of it, in any order): their greedy AR
    continuations (k + 1 tokens longer than the run, so the last round's drafts have a reference)
    and the profile `alpha` (k values)."""
    from specjax.decoding.sequences import GenerationConfig
    from specjax.engine import Decoder
    k = inner.k
    if len(alpha) != k:
        raise ConfigError(f"acceptance profile has {len(alpha)} positions, the drafter proposes {k}")
    if not all(0.0 <= a <= 1.0 for a in alpha):
        raise ConfigError(f"acceptance profile values must be probabilities, got {alpha}")
    gen = GenerationConfig(max_new_tokens=max_new_tokens + k + 1)
    cont = Decoder(target_cfg, target_params, gen).generate(prompts).tokens
    rows = [p + list(c) for p, c in zip(prompts, cont)]
    width = max(len(r) for r in rows) + 2 * (k + 1) + 64
    refs = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        refs[i, :len(r)] = r
    return ReplayDrafter(inner, jnp.asarray(refs), jnp.asarray([len(p) for p in prompts], jnp.int32),
                         jnp.asarray(alpha, jnp.float32), target_cfg.vocab_size)


def fit_profile(alpha: list[float], k: int) -> list[float]:
    """A recorded profile at another draft length -> k positions: cut, or extended by repeating its
    last conditional rate (a run at k says nothing past k)."""
    return [float(a) for a in (list(alpha[:k]) + [alpha[-1]] * max(0, k - len(alpha)))]
