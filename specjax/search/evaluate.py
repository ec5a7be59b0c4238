"""Measuring candidates for real, and the gates every measured candidate must pass.

- Timing: compile first (warm-up run), then `runs` timed runs interleaved with the incumbent, each over
  all of the spec's prompts; tokens/s is the median. The evaluator times generate() itself with its own
  clock; engines' self-reported times are not trusted.
- Floor gate: a run faster than the physical floor (every step at least one weight read at peak
  bandwidth, at most k + 1 tokens per step) is a measurement bug, never a win.
- Forcing gate: the candidate runs under token forcing against the AR reference on the same prompts; a
  single non-near-tie difference rejects it, recorded with position and tokens.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import numpy as np

from specjax.costmodel.model import ModelDims, conditional_acceptance, predict
from specjax.decoding.sequences import GenerationConfig, num_slots_for, prompt_bucket
from specjax.drafters.factory import make_drafter
from specjax.engine import Decoder
from specjax.forcing import check_token_forcing
from specjax.models.loading import LoadedModel
from specjax.search.registry import DRAFTER_KINDS, REGISTRY, drafter_variant


@dataclasses.dataclass
class Measurement:
    config: dict
    tokens_per_s: float  # median over runs
    runs: list[float]
    tokens: int  # generated per run (all prompts)
    tau: float
    acceptance_rates: list[float]
    floor_s: float  # physical floor for one run
    run_s: float  # median seconds for one run
    device: str
    rejected: str | None = None  # why the gates refused it (None: passed)
    forcing: dict | None = None

    @property
    def valid(self) -> bool:
        return self.rejected is None

    @staticmethod
    def failed(config: dict, reason: str, device: str) -> "Measurement":
        """A candidate that produced no measurement (crashed, hung and killed): rejected, never a win."""
        return Measurement(config=dict(config), tokens_per_s=0.0, runs=[], tokens=0, tau=0.0,
                           acceptance_rates=[], floor_s=0.0, run_s=0.0, device=device,
                           rejected=reason)


def candidate_arrays(configs: list[dict], profiles: dict[str, np.ndarray]):
    """Configs -> the cost model's per-candidate arrays (k, kind, layers, alpha)."""
    k, kind, layers, alpha = [], [], [], []
    for c in configs:
        f = REGISTRY.features(c)
        k.append(f["k"])
        kind.append(int(f["draft_kind"]))
        layers.append(f["draft_layers"])
        alpha.append(profiles.get(drafter_variant(c), np.zeros(32)))
    return np.array(k), np.array(kind), np.array(layers), np.stack(alpha)


class Plan:
    """What the loop needs to know about a deployment without running anything: the cost model's
    dimensions and every candidate's physical floor. Shared by in-process and remote evaluators."""

    def __init__(self, target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, device,
                 device_name: str):
        self.target, self.prompts = target, prompts
        stops = target.tokenizer.eos_ids if target.tokenizer else ()
        self.gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_tokens=tuple(stops))
        self.device, self.device_name = device, device_name  # cost-model numbers, and what runs here
        self.measurements = 0

    def dims(self, k: int) -> ModelDims:
        bucket = prompt_bucket(max(len(p) for p in self.prompts))
        return ModelDims.of(self.target.cfg, num_slots_for(bucket, self.gen.max_new_tokens, k))

    def floor_seconds(self, config: dict, tokens: int) -> float:
        """No real run of `tokens` tokens can be faster than this."""
        f = REGISTRY.features(config)
        k = int(f["k"])
        kind = int(f["draft_kind"])
        best_alpha = np.ones((1, 32))  # every draft accepted: the fewest steps possible
        p = predict(self.dims(k), self.device, [k], [kind], [f["draft_layers"]], best_alpha)
        steps = np.ceil(tokens / (k + 1 if kind else 1))
        return float(steps * p["floor_time"][0])

    def evaluate_many(self, jobs: list[tuple[dict, int, dict | None]]) -> list[tuple[Measurement, Measurement | None]]:
        """Measure and gate several candidates; remote evaluators run them in parallel."""
        return [self.evaluate(*job) for job in jobs]

    def evaluate(self, config: dict, runs: int, incumbent: dict | None = None):
        m, inc = self.measure(config, runs, incumbent)
        return self.gate(m), inc

    def close(self):
        """Release workers (nothing to release in-process)."""


class Evaluator(Plan):
    """Measures candidates in this process, on this process's device."""

    def __init__(self, target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, device,
                 device_name: str, forcing_tolerance: float = 1e-3, floor_tolerance: float = 0.1,
                 timer: Callable[[], float] = time.perf_counter,
                 build_decoder: Callable[[dict], Decoder] | None = None, batch: int = 1):
        super().__init__(target, prompts, max_new_tokens, device, device_name)
        # the deployment's batch size: a run serves the prompts `batch` at a time
        self.batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        self.forcing_tolerance, self.floor_tolerance = forcing_tolerance, floor_tolerance
        self.timer = timer
        self.build_decoder = build_decoder or self._build
        self._decoders: dict[str, Decoder] = {}
        ar = Decoder(target.cfg, target.params, self.gen)
        self.references = [ar.generate(b) for b in self.batches]

    def _build(self, config: dict) -> Decoder:
        kw = REGISTRY.apply(config)
        drafter = None if kw["drafter"] is None else make_drafter(kw["drafter"], self.target, kw["k"])
        return Decoder(self.target.cfg, self.target.params, self.gen, drafter)

    def decoder(self, config: dict) -> Decoder:
        key = repr(sorted(config.items()))
        if key not in self._decoders:
            self._decoders[key] = self.build_decoder(config)
        return self._decoders[key]

    def _run_once(self, dec: Decoder, seed: int):
        """One timed pass over every prompt -> (seconds, generated tokens, tau, acceptance rates)."""
        t = self.timer()
        results = [dec.generate(b, seed=seed) for b in self.batches]
        seconds = self.timer() - t
        tokens = sum(r.num_generated for r in results)
        hist = [r.accepted_hist.sum(axis=0) for r in results if r.accepted_hist is not None]
        tau, rates = 1.0, []
        if hist:
            h = np.sum(hist, axis=0)
            tau = float((h * np.arange(1, len(h) + 1)).sum() / max(h.sum(), 1))
            at_least = np.cumsum(h[::-1])[::-1]
            rates = [float(at_least[i] / max(h.sum(), 1)) for i in range(1, len(h))]
        return seconds, (tokens, tau, rates)

    def measure(self, config: dict, runs: int, incumbent: dict | None = None) -> tuple[Measurement, Measurement | None]:
        """Median of `runs` timed runs, interleaved with the incumbent's when one is given."""
        self.measurements += 1
        dec = self.decoder(config)
        self._run_once(dec, 0)  # compile + warm up
        inc_dec = self.decoder(incumbent) if incumbent is not None else None
        if inc_dec is not None:
            self._run_once(inc_dec, 0)
        times, inc_times = [], []
        for i in range(runs):
            seconds, result = self._run_once(dec, i)
            times.append(seconds)
            if inc_dec is not None:
                inc_times.append(self._run_once(inc_dec, i)[0])
        m = self._summarize(config, result, times)
        inc = self._summarize(incumbent, None, inc_times) if inc_dec is not None else None
        return m, inc

    def _summarize(self, config, result, times) -> Measurement:
        tokens, tau, rates = result if result else (
            sum(len(t) for r in self.references for t in r.tokens), float("nan"), [])
        median_s = statistics.median(times)
        m = Measurement(config=dict(config), tokens_per_s=tokens / median_s,
                        runs=[tokens / t for t in times], tokens=tokens, tau=tau, acceptance_rates=rates,
                        floor_s=self.floor_seconds(config, tokens), run_s=median_s, device=self.device_name)
        if median_s < (1.0 - self.floor_tolerance) * m.floor_s:
            m.rejected = (f"measured {median_s * 1e3:.2f} ms per run is under the physical floor "
                          f"{m.floor_s * 1e3:.2f} ms: a measurement bug, not a win")
        return m

    def gate(self, m: Measurement) -> Measurement:
        """Token forcing against the AR reference (plain AR itself needs no gate)."""
        if m.rejected or REGISTRY.apply(m.config)["drafter"] is None:
            return m
        dec = self.decoder(m.config)
        reports = [check_token_forcing(dec, b, ref, self.forcing_tolerance)
                   for b, ref in zip(self.batches, self.references)]
        failures = [f for r in reports for f in r.failures]
        m.forcing = {"checked": sum(r.checked for r in reports), "expected": sum(r.expected for r in reports),
                     "failures": len(failures), "near_ties": sum(len(r.near_tie_mismatches) for r in reports),
                     "tolerance": self.forcing_tolerance,
                     "first_failures": [dataclasses.asdict(f) for f in failures[:5]]}
        if failures or not all(r.passed for r in reports):
            first = f"; first: {failures[0]}" if failures else ""
            m.rejected = (f"token forcing: {m.forcing['failures']} mismatches, "
                          f"{m.forcing['checked']}/{m.forcing['expected']} positions checked{first}")
        return m

    def acceptance_profile(self, config: dict, pilot_k: int = 8) -> np.ndarray:
        """Conditional per-position acceptance of a drafter variant, from one run at k = pilot_k."""
        cfg = dict(config, **{"drafter.k": pilot_k})
        if cfg.get("drafter.kind", "none") == "none":
            return np.zeros(32)
        self.measurements += 1
        _, (_, _, rates) = self._run_once(self.decoder(cfg), 0)
        return conditional_acceptance(rates)


__all__ = ["Plan", "Evaluator", "Measurement", "candidate_arrays", "DRAFTER_KINDS"]
