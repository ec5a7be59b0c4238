"""Token forcing: the judge every mechanism answers to.

Given a reference continuation from plain greedy AR decoding of the same target, run the engine under
test through its own draft/verify path with the reference forced: at every step the engine's chosen
tokens are compared with the reference at the same positions, and the reference (not the engine's
choice) is committed, so one early difference cannot hide or cause later ones. Every generated
position is checked exactly once.

A position whose reference top-1/top-2 logit margin is below `tolerance` is a near-tie: a difference
there can come from float reduction order alone, so it is counted and reported apart, never hidden.
Any other difference is a failure, reported with its position and both tokens.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.decoding.chain import Forced
from specjax.decoding.sequences import Sequences
from specjax.errors import ConfigError
from specjax.rounding import exact_jit


@dataclasses.dataclass
class Mismatch:
    prompt: int
    position: int  # index into the generated continuation
    engine_token: int
    reference_token: int
    margin: float  # the reference's top-1 minus top-2 logit there

    def __str__(self):
        return (f"prompt {self.prompt} position {self.position}: engine chose {self.engine_token}, "
                f"reference {self.reference_token} (margin {self.margin:.3g})")


@dataclasses.dataclass
class ForcingReport:
    tolerance: float
    checked: int  # positions compared
    expected: int  # positions in the reference continuations
    near_tie_positions: int  # reference positions with margin < tolerance
    failures: list[Mismatch]  # differences at positions that are not near-ties
    near_tie_mismatches: list[Mismatch]

    @property
    def passed(self) -> bool:
        return not self.failures and self.checked == self.expected

    def summary(self) -> str:
        return (f"token forcing: {self.checked}/{self.expected} positions checked, "
                f"{len(self.failures)} mismatches, {len(self.near_tie_mismatches)} near-tie differences "
                f"(of {self.near_tie_positions} near-tie positions, margin < {self.tolerance:g})")


def build_forced(prompts: list[list[int]], reference_tokens: list[list[int]], num_slots: int) -> Forced:
    B = len(prompts)
    ref = np.zeros((B, num_slots), np.int32)
    ref_len = np.zeros(B, np.int32)
    for b, (p, r) in enumerate(zip(prompts, reference_tokens)):
        seq = list(p) + list(r)
        ref[b, :len(seq)] = seq
        ref_len[b] = len(seq)
    zeros = jnp.zeros((B, num_slots), jnp.int32)
    return Forced(ref_tokens=jnp.asarray(ref), ref_length=jnp.asarray(ref_len),
                  mismatch=jnp.zeros((B, num_slots), bool), engine_token=zeros,
                  checked=jnp.zeros((B, num_slots), bool))


@exact_jit
def force_first_token(forced: Forced, seqs: Sequences) -> tuple[Forced, Sequences]:
    """Check and replace the token chosen by prefill (sequence index prompt_len)."""
    rows = jnp.arange(seqs.tokens.shape[0])
    pos = seqs.prompt_len
    mine = seqs.tokens[rows, pos]
    ref = forced.ref_tokens[rows, pos]
    forced = dataclasses.replace(
        forced,
        mismatch=forced.mismatch.at[rows, pos].set(mine != ref),
        engine_token=forced.engine_token.at[rows, pos].set(mine),
        checked=forced.checked.at[rows, pos].set(True))
    seqs = dataclasses.replace(seqs, tokens=seqs.tokens.at[rows, pos].set(ref),
                               done=seqs.length >= forced.ref_length)
    return forced, seqs


def check_token_forcing(decoder, prompts: list[list[int]], reference, tolerance: float = 1e-3
                        ) -> ForcingReport:
    """Run `decoder` (a speculative engine.Decoder) forced along `reference` (a greedy AR
    GenerationResult for the same prompts and target) and report every difference."""
    if not decoder.gen.sampling.greedy:
        raise ConfigError("token forcing compares greedy choices; use temperature 0")
    if decoder.drafter is None:
        raise ConfigError("token forcing runs a speculative engine; this decoder has no drafter")
    _, _, num_slots = decoder.pack(prompts)
    forced = build_forced(prompts, reference.tokens, num_slots)
    result = decoder.generate(prompts, forced=forced)
    f = result.forced
    failures, ties = [], []
    checked = expected = near = 0
    for b, (p, ref_tokens) in enumerate(zip(prompts, reference.tokens)):
        lo, hi = len(p), len(p) + len(ref_tokens)
        checked += int(f["checked"][b, lo:hi].sum())
        expected += hi - lo
        margins = reference.margins[b]
        near += sum(m < tolerance for m in margins)
        for pos in np.nonzero(f["mismatch"][b, lo:hi])[0]:
            m = Mismatch(b, int(pos), int(f["engine_token"][b, lo + pos]), int(ref_tokens[pos]),
                         float(margins[pos]))
            (ties if m.margin < tolerance else failures).append(m)
    return ForcingReport(tolerance, checked, expected, near, failures, ties)
