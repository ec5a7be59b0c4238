"""Measuring candidates for real, and the gates every measured candidate must pass.

- Timing: compile first (warm-up run), then `runs` timed runs interleaved with the incumbent, each over
  all of the spec's prompts; tokens/s is the median. The evaluator times generate() itself with its own
  clock; engines' self-reported times are not trusted.
- Floor gate: a run faster than the physical floor (every step at least one weight read at peak
  bandwidth, at most k + 1 tokens per step) is a measurement bug, never a win.
- Forcing gate: the candidate runs under token forcing against the AR reference on the same prompts; a
  single non-near-tie difference rejects it, recorded with position and tokens. A candidate without a
  drafter but with other engine changes (weight formats, kernel tiles) is compared token by token
  with the reference instead: its first divergence must be a near tie.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from specjax.costmodel.model import ModelDims, conditional_acceptance, predict
from specjax.decoding.sequences import GenerationConfig, num_slots_for, prompt_bucket
from specjax.drafters.factory import make_drafter
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.forcing import check_token_forcing
from specjax.models.loading import LoadedModel
from specjax.search.registry import DRAFTER_KINDS, REGISTRY, WEIGHT_GROUPS, drafter_variant, pilot_k

STOCK_ENGINE = {"weights_format": {g: "bf16" for g in WEIGHT_GROUPS}, "kernel_tiles": "default", "tree": None,
                "serving": None, "kernels": "xla"}


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
    decode_s: float = 0.0  # the engine's own decode-loop seconds in the last run (calibration only)
    steps: int = 0  # decode-loop iterations in the last run, all prompts

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


def cost_inputs(configs: list[dict], profiles: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Configs -> every per-candidate array of `predict` (keyword arguments): the drafter's
    (k, kind, layers, alpha), per weight group the bytes factor and LH12 flag [C, 3], and the
    tuned-tiles and Pallas-kernels flags [C]."""
    k, kind, layers, alpha = candidate_arrays(configs, profiles)
    feats = [REGISTRY.features(c) for c in configs]
    return dict(k=k, kind=kind, layers=layers, alpha=alpha,
                tree_nodes=np.array([f["tree_nodes"] for f in feats]),
                bytes_factor=np.array([[f[f"weights_{g}_bytes"] for g in WEIGHT_GROUPS] for f in feats]),
                lh12=np.array([[f[f"weights_{g}_lh12"] for g in WEIGHT_GROUPS] for f in feats]),
                tuned=np.array([f["kernels_tuned"] for f in feats]),
                pallas=np.array([f["kernels_pallas"] for f in feats]),
                budget=np.array([f["serving_budget"] for f in feats]),
                packed=np.array([f["serving_packed"] for f in feats]),
                steps_per_call=np.array([f["serving_steps"] for f in feats]),
                two_level_k1=np.array([f["serving_k1"] for f in feats]),
                kv_passes=np.array([f["serving_kv_passes"] for f in feats]),
                two_level_tokens=np.array([f["serving_k2_tokens"] for f in feats]))


def engine_changes(config: dict) -> dict:
    """The engine keyword arguments a config sets away from the stock engine (weight formats,
    kernel tiles): only these are passed on, so engines that predate them build as before."""
    kw = REGISTRY.apply(config)
    return {name: kw[name] for name, stock in STOCK_ENGINE.items() if kw.get(name, stock) != stock}


class Plan:
    """What the loop needs to know about a deployment without running anything: the cost model's
    dimensions and every candidate's physical floor. Shared by in-process and remote evaluators."""

    def __init__(self, target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, device,
                 device_name: str, batch: int = 1):
        self.target, self.prompts = target, prompts
        self.batch = batch  # requests served together: the cost model prices whole-batch steps
        stops = target.tokenizer.eos_ids if target.tokenizer else ()
        self.gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_tokens=tuple(stops))
        self.device, self.device_name = device, device_name  # cost-model numbers, and what runs here
        self.bucket = prompt_bucket(max(len(p) for p in prompts))  # one compiled shape for every batch
        self.measurements = 0
        # the target's LH12 bits per weight per group (attn, mlp, head), when measured
        # (specjax/costmodel/weight_bits.py); None: the registry's nominal figure
        self.lh12_bits: tuple[float, float, float] | None = None
        self.tp = 1  # tensor-parallel devices (deployment.tp): the cost model prices the collectives

    def dims(self, k: int) -> ModelDims:
        dims = ModelDims.of(self.target.cfg, num_slots_for(self.bucket, self.gen.max_new_tokens, k),
                            lh12_bits=self.lh12_bits)
        return dataclasses.replace(dims, batch=self.batch, tp=self.tp)

    def floor_seconds(self, config: dict, tokens: int) -> float:
        """No real run of `tokens` tokens can be faster than this (12-bit weights lower it)."""
        inputs = cost_inputs([config], {})
        k, kind = int(inputs["k"][0]), int(inputs["kind"][0])
        inputs["alpha"] = np.ones((1, 32))  # every draft accepted: the fewest steps possible
        p = predict(self.dims(k), self.device, **inputs)
        steps = np.ceil(tokens / (self.batch * (k + 1 if kind else 1)))  # a step serves the batch
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
        super().__init__(target, prompts, max_new_tokens, device, device_name, batch)
        # the deployment's batch size: a run serves the prompts `batch` at a time
        self.batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        self.forcing_tolerance, self.floor_tolerance = forcing_tolerance, floor_tolerance
        self.timer = timer
        self.build_decoder = build_decoder or self._build
        self._decoders: dict[str, Decoder] = {}
        ar = Decoder(target.cfg, target.params, self.gen, min_prompt_bucket=self.bucket)
        self.references = [ar.generate(b) for b in self.batches]

    def _build(self, config: dict) -> Decoder:
        kw = REGISTRY.apply(config)
        drafter = None if kw["drafter"] is None else make_drafter(
            kw["drafter"], self.target, kw["k"], prompts=self.prompts, max_new_tokens=self.gen.max_new_tokens)
        changes = engine_changes(config)
        if "serving" in changes:  # a batching mechanism: the continuous-batching engine, `batch` slots
            from specjax.serving.decoder import ServingDecoder
            skip = ("serving", "tree")  # a tree rides in the serving options
            rest = {k: v for k, v in changes.items() if k not in skip}
            if rest:
                raise ConfigError(f"the serving engine runs bf16 XLA weights; this config also "
                                  f"sets {sorted(rest)}")
            mesh = None
            if getattr(self, "tp", 1) > 1:  # plans built before tp existed, and test fakes
                from specjax.sharding.tp import tp_mesh
                mesh = tp_mesh(self.tp)
            return ServingDecoder(self.target.cfg, self.target.params, self.gen, drafter,
                                  num_slots=self.batch, options=changes["serving"], prompt_width=self.bucket,
                                  mesh=mesh)
        if getattr(self, "tp", 1) > 1:  # plans built before tp existed, and test fakes
            from specjax.sharding.tp import tp_mesh
            changes["mesh"] = tp_mesh(self.tp)
        return Decoder(self.target.cfg, self.target.params, self.gen, drafter, min_prompt_bucket=self.bucket,
                       **changes)

    def decoder(self, config: dict) -> Decoder:
        key = repr(sorted(config.items()))
        if key not in self._decoders:
            self._decoders[key] = self.build_decoder(config)
        return self._decoders[key]

    def prepare(self, configs: list[dict], threads: int | None = None):
        """Compile the decoders of several candidates at once (XLA compiles outside the GIL), so a
        batch of measurements pays about one compile's wall time instead of one per candidate. Each
        compile is followed by one short run, the forced (gate) path included."""
        todo = []
        for c in configs:
            key = repr(sorted(c.items()))
            if key not in self._decoders and key not in todo:
                todo.append(key)
                self.decoder(c)
        if len(todo) < 2:
            return

        def warm(key):
            dec = self._decoders[key]
            dec.generate(self.batches[0])
            if dec.drafter is not None:
                check_token_forcing(dec, self.batches[0], self.references[0], self.forcing_tolerance)
        with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
            list(pool.map(warm, todo))

    def evaluate_many(self, jobs):
        self.prepare([c for job in jobs for c in (job[0], job[2]) if c is not None])
        return [self.evaluate(*job) for job in jobs]

    def _run_once(self, dec: Decoder, seed: int) -> tuple[float, dict]:
        """One timed pass over every prompt -> (seconds on our clock, what the run produced). The
        engine's own decode-loop time and step count are kept for calibration, never for scoring."""
        t = self.timer()
        results = [dec.generate(b, seed=seed) for b in self.batches]
        seconds = self.timer() - t
        hist = [r.accepted_hist.sum(axis=0) for r in results if r.accepted_hist is not None]
        tau, rates = 1.0, []
        if hist:
            h = np.sum(hist, axis=0)
            tau = float((h * np.arange(1, len(h) + 1)).sum() / max(h.sum(), 1))
            at_least = np.cumsum(h[::-1])[::-1]
            rates = [float(at_least[i] / max(h.sum(), 1)) for i in range(1, len(h))]
        return seconds, {"tokens": sum(r.num_generated for r in results), "tau": tau, "rates": rates,
                         "decode_s": sum(r.decode_s for r in results), "steps": sum(r.steps for r in results)}

    def measure_interleaved(self, configs: list[dict], runs: int) -> list[Measurement]:
        """Warm every config up, then `runs` rounds of one timed run each, in turn: slow drifts of the
        machine hit every config alike. Each gets the median of its runs."""
        decoders = [self.decoder(c) for c in configs]
        for dec in decoders:
            self._run_once(dec, 0)  # compile + warm up
        times = [[] for _ in configs]
        last = [None] * len(configs)
        for i in range(runs):
            for j, dec in enumerate(decoders):
                seconds, last[j] = self._run_once(dec, i)
                times[j].append(seconds)
        return [self._summarize(c, r, t) for c, r, t in zip(configs, last, times)]

    def measure(self, config: dict, runs: int, incumbent: dict | None = None) -> tuple[Measurement, Measurement | None]:
        """Median of `runs` timed runs, interleaved with the incumbent's when one is given."""
        self.measurements += 1
        if incumbent is None:
            return self.measure_interleaved([config], runs)[0], None
        m, inc = self.measure_interleaved([config, incumbent], runs)
        return m, inc

    def _summarize(self, config, result: dict, times: list[float]) -> Measurement:
        tokens = result["tokens"]
        median_s = statistics.median(times)
        m = Measurement(config=dict(config), tokens_per_s=tokens / median_s,
                        runs=[tokens / t for t in times], tokens=tokens, tau=result["tau"],
                        acceptance_rates=result["rates"], floor_s=self.floor_seconds(config, tokens),
                        run_s=median_s, device=self.device_name, decode_s=result["decode_s"],
                        steps=result["steps"])
        if median_s < (1.0 - self.floor_tolerance) * m.floor_s:
            m.rejected = (f"measured {median_s * 1e3:.2f} ms per run is under the physical floor "
                          f"{m.floor_s * 1e3:.2f} ms: a measurement bug, not a win")
        return m

    def gate(self, m: Measurement) -> Measurement:
        """Token forcing against the AR reference (plain AR itself needs no gate; AR on another
        engine, e.g. 12-bit weights, is compared with the reference token by token)."""
        if m.rejected:
            return m
        if REGISTRY.apply(m.config)["drafter"] is None:
            return self._gate_plain(m) if engine_changes(m.config) else m
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

    def _gate_plain(self, m: Measurement) -> Measurement:
        """No drafter to force: generate, and accept only if each sequence equals the reference up
        to its first difference and that difference is a near tie (after it, the two continue from
        different prefixes and say nothing more)."""
        dec = self.decoder(m.config)
        checked, first = 0, None
        for batch, ref in zip(self.batches, self.references):
            out = dec.generate(batch)
            for b, (got, want) in enumerate(zip(out.tokens, ref.tokens)):
                diff = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                            None if len(got) == len(want) else min(len(got), len(want)))
                checked += len(want) if diff is None else diff + 1
                if diff is not None and diff < len(want) and ref.margins[b][diff] >= self.forcing_tolerance:
                    first = first or (b, diff, got[diff] if diff < len(got) else None, want[diff],
                                      float(ref.margins[b][diff]))
        m.forcing = {"checked": checked, "expected": sum(len(t) for r in self.references for t in r.tokens),
                     "failures": int(first is not None), "near_ties": 0, "tolerance": self.forcing_tolerance,
                     "first_failures": [] if first is None else [dict(zip(
                         ("batch", "position", "engine_token", "reference_token", "margin"), first))]}
        if first is not None:
            m.rejected = (f"tokens differ from AR at a decided position: batch {first[0]} position "
                          f"{first[1]}: {first[2]} vs {first[3]} (margin {first[4]:.3g})")
        return m

    def acceptance_profile(self, config: dict, pilot: int | None = None) -> np.ndarray:
        """Conditional per-position acceptance of a drafter variant, from one run at k = `pilot`
        (default: the registry's pilot k for it)."""
        cfg = dict(config, **{"drafter.k": pilot_k(config) if pilot is None else pilot})
        if cfg.get("drafter.kind", "none") == "none":
            return np.zeros(32)
        self.measurements += 1
        _, result = self._run_once(self.decoder(cfg), 0)
        return conditional_acceptance(result["rates"])


__all__ = ["Plan", "Evaluator", "Measurement", "candidate_arrays", "cost_inputs", "engine_changes",
           "DRAFTER_KINDS"]
