"""The search loop. Each round:

    gap attribution (cost model on the incumbent) -> directions (components with the largest gaps)
    -> N agents propose mutations within their direction -> validate against the spec
    -> cost-model screen (one jit+vmap call) -> measure the best few for real (interleaved with the
    incumbent) -> floor gate + token-forcing gate -> combine compatible winners -> new incumbent
    -> memory record for every validated improvement.

State is saved atomically after every measurement, so a killed search resumes with `--resume` and
re-measures nothing it already has; memory records are written only after the gates passed.
The kernel sub-agent's place: `kernel_agent` (unused so far: `specjax tune-kernels` tunes the tiles
before a search, and the search chooses between default and tuned ones).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from specjax.atomic import read_json_checked, write_json_atomic
from specjax.costmodel.model import predict
from specjax.provenance import code_commit
from specjax.search.evaluate import Evaluator, Measurement, cost_inputs
from specjax.search.registry import COMPONENTS, REGISTRY, drafter_variant, pilot_k
from specjax.search.report import replayed
from specjax.search.spec import SearchSpec

AR_CONFIG = {"drafter.kind": "none"}
MIN_GAIN = 1.02  # a winner must beat the incumbent by 2% in the interleaved measurement


def config_key(config: dict) -> str:
    return repr(sorted(config.items()))


@dataclasses.dataclass
class SearchState:
    round: int = 0
    ar: dict | None = None  # Measurement as dict
    stock: dict | None = None
    incumbent: dict | None = None  # Measurement as dict
    profiles: dict = dataclasses.field(default_factory=dict)  # drafter variant -> alpha list
    evaluated: dict = dataclasses.field(default_factory=dict)  # config key -> record
    history: list = dataclasses.field(default_factory=list)  # per round summary
    records: list = dataclasses.field(default_factory=list)  # memory record ids written
    measurements: int = 0
    elapsed_s: float = 0.0

    def save(self, path: Path):
        write_json_atomic(path, dataclasses.asdict(self))

    @staticmethod
    def load(path: Path) -> "SearchState":
        return SearchState(**read_json_checked(path))


def _m(d: dict) -> Measurement:
    return Measurement(**d)


class Search:
    def __init__(self, spec: SearchSpec, evaluator: Evaluator, proposer, output_dir: str | Path,
                 memory=None, agents: int | None = None, progress: Callable[[str], None] = print,
                 kernel_agent=None, refit_from_ar: bool = False):
        self.spec, self.ev, self.proposer = spec, evaluator, proposer
        self.out = Path(output_dir)
        self.state_path = self.out / "state.json"
        self.memory, self.progress, self.kernel_agent = memory, progress, kernel_agent
        self.refit_from_ar = refit_from_ar  # ranking numbers are this device's: refit fixed costs to AR
        self.agents = agents or spec.budget.agents
        self.state = SearchState()
        self._start = time.monotonic()
        self._best_predicted: float | None = None

    # ------------------------------------------------------------------ cost model

    def predict(self, configs: list[dict]) -> dict:
        profiles = {k: np.asarray(v) for k, v in self.state.profiles.items()}
        inputs = cost_inputs(configs, profiles)
        dims = self.ev.dims(int(max(inputs["k"].max(), 1)))
        return predict(dims, self.ev.device, **inputs)

    def _with_defaults(self, config: dict) -> dict:
        """Active parameters a config leaves out at their registry defaults (weight formats, kernel
        tiles): what an engine that never heard of them runs. So plain AR and memory seeds from
        spaces without them are valid configs of this space."""
        config = dict(config)
        defaults = REGISTRY.stock()
        for name, p in self.spec.space.items():  # parents come first
            if name not in config and name in defaults and p.active(config):
                config[name] = defaults[name]
        return config

    def _ar_config(self) -> dict:
        return self._with_defaults(AR_CONFIG)

    def _variants(self) -> list[dict]:
        """One config per drafter variant in the space (acceptance depends on the variant, not on k)."""
        seen, out = set(), []
        names = [n for n in self.spec.space if n != "drafter.k"]
        grids = [self.spec.space[n].grid() for n in names]
        for combo in itertools.islice(itertools.product(*grids), 5000):
            c = self.spec.canonical(dict(zip(names, combo)))
            v = drafter_variant(c)
            if v not in seen and c.get("drafter.kind", "none") != "none":
                seen.add(v)
                out.append(c)
        return out

    def _profiled(self, config: dict) -> bool:
        return config.get("drafter.kind", "none") == "none" or drafter_variant(config) in self.state.profiles

    # ------------------------------------------------------------------ measuring

    def _measure(self, config: dict, incumbent: dict | None) -> Measurement:
        return self._measure_many([config], incumbent)[0]

    def _measure_many(self, configs: list[dict], incumbent: dict | None) -> list[Measurement]:
        """Measure + gate the configs not measured yet (in parallel where the evaluator has several
        workers), record each in the state as it lands, and return every config's measurement."""
        fresh = [c for c in configs if config_key(c) not in self.state.evaluated]
        self._status("measuring")
        results = self.ev.evaluate_many([(c, self.spec.budget.runs, incumbent) for c in fresh])
        predicted = self.predict(fresh)["tokens_per_s"] if fresh else []
        for c, (m, inc), pred in zip(fresh, results, predicted):
            entry = {"measurement": dataclasses.asdict(m), "round": self.state.round,
                     "vs_incumbent": (m.tokens_per_s / inc.tokens_per_s) if inc and m.valid else None,
                     "predicted_tokens_per_s": float(pred)}
            self.state.evaluated[config_key(c)] = entry
            self.state.measurements = self.ev.measurements
            self.state.save(self.state_path)
            verdict = "ok" if m.valid else f"REJECTED ({m.rejected})"
            self.progress(f"  measured {c}: {m.tokens_per_s:.1f} tok/s, tau {m.tau:.2f} -> {verdict}")
        self._status("screening")
        return [_m(self.state.evaluated[config_key(c)]["measurement"]) for c in configs]

    def _status(self, phase: str):
        """Feed a live display (progress objects with a `status` method); plain callables get lines only."""
        status = getattr(self.progress, "status", None)
        if status is None or self.state.ar is None:
            return
        inc = self.state.incumbent
        status({"round": self.state.round, "rounds": self.spec.budget.rounds,
                "measurements": self.ev.measurements, "incumbent": inc["config"] if inc else {},
                "speedup": self._speedup(_m(inc)) if inc else 1.0, "best_predicted": self._best_predicted,
                "elapsed_s": self.state.elapsed_s + time.monotonic() - self._start, "phase": phase})

    def _speedup(self, m: Measurement) -> float:
        return m.tokens_per_s / _m(self.state.ar).tokens_per_s

    def _remember(self, m: Measurement):
        if self.memory is None or not m.valid or m.forcing is None:
            return
        from specjax.memory.store import MemoryRecord, utc_now
        stock = self.state.stock["config"] if self.state.stock else {}
        pred = self.predict([m.config])
        ar_pred = self.predict([AR_CONFIG])
        record = MemoryRecord(
            spec_name=self.spec.name, deployment=self.spec.deployment.fingerprint(), config=m.config,
            config_delta={k: v for k, v in m.config.items() if stock.get(k) != v},
            measured={"tokens_per_s": m.tokens_per_s, "speedup": self._speedup(m), "runs": len(m.runs),
                      "device": m.device},
            predicted={"tokens_per_s": float(pred["tokens_per_s"][0]),
                       "speedup": float(pred["tokens_per_s"][0] / ar_pred["tokens_per_s"][0])},
            forcing={k: m.forcing[k] for k in ("checked", "expected", "failures", "near_ties", "tolerance")},
            git_commit=code_commit(), device=m.device, created=utc_now())
        rec = self.memory.put(record)
        if rec.record_id not in self.state.records:
            self.state.records.append(rec.record_id)
            self.state.save(self.state_path)

    # ------------------------------------------------------------------ the loop

    def run(self, resume: bool = False) -> SearchState:
        start = self._start = time.monotonic()
        if resume and self.state_path.exists():
            self.state = SearchState.load(self.state_path)
            self.progress(f"resuming at round {self.state.round} with {len(self.state.evaluated)} measured")
        budget = self.spec.budget
        if self.state.ar is None:
            self.progress("measuring plain AR (the baseline every speedup is over)")
            m, _ = self.ev.measure(self._ar_config(), budget.runs)
            if not m.valid:
                raise RuntimeError(f"the AR baseline failed its floor gate: {m.rejected}")
            self.state.ar = dataclasses.asdict(m)
            self.state.save(self.state_path)
        if self.refit_from_ar:
            from specjax.costmodel.hardware import fit_to_ar
            ar = _m(self.state.ar)
            forward_s = float(self.predict([AR_CONFIG])["component_time"][0][0])
            self.ev.device = fit_to_ar(self.ev.device, ar.run_s, ar.decode_s, ar.steps, ar.tokens, forward_s)
            self.progress(f"cost model refit to AR: commit {self.ev.device.round_overhead * 5e5:.1f} us per "
                          f"AR step, host {self.ev.device.host_per_token * 1e6:.1f} us per token")
        pending = [c for c in self._variants() if drafter_variant(c) not in self.state.profiles]
        if hasattr(self.ev, "prepare"):  # compile every pilot at once
            self.ev.prepare([dict(c, **{"drafter.k": pilot_k(c)}) for c in pending])
        for c in self._variants():
            v = drafter_variant(c)
            if v not in self.state.profiles:
                self.progress(f"acceptance pilot for {v}")
                self.state.profiles[v] = self.ev.acceptance_profile(c).tolist()
                self.state.save(self.state_path)
        if self.state.stock is None:
            self.progress(f"measuring stock {self.spec.stock}")
            m = self._measure(self.spec.canonical(self.spec.stock), None)
            self.state.stock = dataclasses.asdict(m)
            # Not speculating is a valid answer too: plain AR competes when the space allows it.
            ar = _m(self.state.ar)
            ar_allowed = self.spec.is_valid(self.spec.canonical(self._ar_config()))
            base = m if m.valid and (not ar_allowed or m.tokens_per_s >= ar.tokens_per_s) else ar
            self.state.incumbent = dataclasses.asdict(base)
            self._remember(m)
            self.state.save(self.state_path)

        while self.state.round < budget.rounds:
            if time.monotonic() - start + self.state.elapsed_s > budget.wall_clock_s:
                self.progress("wall-clock budget spent")
                break
            self._round()
        self.state.elapsed_s += time.monotonic() - start
        self.state.save(self.state_path)
        return self.state

    def _round(self):
        r = self.state.round
        incumbent = _m(self.state.incumbent)
        pred = self.predict([incumbent.config])
        gaps = pred["component_gap"][0]
        order = np.argsort(-gaps)
        # a direction is a large gap that some parameter of this space can move (host cost: none yet)
        movable = [i for i in order if set(REGISTRY.params_for(COMPONENTS[i])) & set(self.spec.space)]
        movable = movable or list(order)
        directions = [COMPONENTS[movable[j % len(movable)]] for j in range(self.agents)]
        self.progress(f"round {r}: incumbent {incumbent.config} {incumbent.tokens_per_s:.1f} tok/s "
                      f"({self._speedup(incumbent):.2f}x AR); gaps " +
                      ", ".join(f"{COMPONENTS[i]} {gaps[i] * 1e3:.2f} ms" for i in order))
        seeds = []
        if self.memory is not None and r == 0:
            from specjax.memory.store import seed_configs
            seeds = seed_configs(self.memory, self.spec.deployment.fingerprint())

        def agent(i):
            return self.proposer.propose(self.spec, incumbent.config, directions[i],
                                         self.spec.budget.proposals_per_agent, r, i, seeds if i == 0 else ())
        with ThreadPoolExecutor(max_workers=self.agents) as pool:
            proposals = [c for batch in pool.map(agent, range(self.agents)) for c in batch]
        candidates, seen = [], {config_key(incumbent.config)}
        for c in proposals:
            c = self.spec.canonical(self._with_defaults(c))
            if self.spec.is_valid(c) and config_key(c) not in seen and self._profiled(c):
                seen.add(config_key(c))
                candidates.append(c)
        winners = []
        if candidates:
            p = self.predict(candidates)
            self._best_predicted = float(p["tokens_per_s"].max())  # tok/s, for the live display
            ranked = [candidates[i] for i in np.argsort(-p["tokens_per_s"])]
            fresh = [c for c in ranked if config_key(c) not in self.state.evaluated]
            chosen = fresh[:self.spec.budget.measure_per_round]
            for c, m in zip(chosen, self._measure_many(chosen, incumbent.config)):
                gain = self.state.evaluated[config_key(c)]["vs_incumbent"]
                # replayed acceptance is an estimate, not a deployable drafter: reported, never
                # promoted, so never kept in the memory store either
                if m.valid and gain is not None and gain > MIN_GAIN and not replayed(c):
                    winners.append(m)
        winners = self._combine(winners, incumbent)
        best = max(winners, key=lambda m: m.tokens_per_s, default=None)
        if best is not None:
            # re-measure the winner interleaved with the incumbent before promoting it
            again, inc = self.ev.measure(best.config, self.spec.budget.runs, incumbent.config)
            if inc is not None and again.valid and again.tokens_per_s > inc.tokens_per_s * MIN_GAIN:
                self.state.incumbent = dataclasses.asdict(best)
                for w in winners:
                    self._remember(w)
            else:
                self.progress(f"  {best.config} did not hold up when re-measured; incumbent kept")
        if self.kernel_agent is not None:
            self.kernel_agent(self)
        inc_now = _m(self.state.incumbent)
        self.state.history.append({
            "round": r, "directions": directions, "proposals": len(proposals), "screened": len(candidates),
            "measured": len(self.state.evaluated), "incumbent": inc_now.config,
            "incumbent_tokens_per_s": inc_now.tokens_per_s, "speedup": self._speedup(inc_now),
            "predicted_tokens_per_s": float(self.predict([inc_now.config])["tokens_per_s"][0]),
            "ceiling_tokens_per_s": float(self.predict([inc_now.config])["ceiling_tokens_per_s"][0]),
            "gaps_ms": {COMPONENTS[i]: float(gaps[i] * 1e3) for i in range(len(COMPONENTS))}})
        self.state.round = r + 1
        self.state.measurements = self.ev.measurements
        self.state.save(self.state_path)

    def _combine(self, winners: list[Measurement], incumbent: Measurement) -> list[Measurement]:
        """Merge pairs of winners that changed disjoint parameters; measure the merge if valid."""
        base = incumbent.config
        out = list(winners)
        for i in range(len(winners)):
            for j in range(i + 1, len(winners)):
                da = {k: v for k, v in winners[i].config.items() if base.get(k) != v}
                db = {k: v for k, v in winners[j].config.items() if base.get(k) != v}
                if set(da) & set(db):
                    continue
                merged = self.spec.canonical({**base, **da, **db})
                if self.spec.is_valid(merged) and self._profiled(merged):
                    m = self._measure(merged, base)
                    if m.valid:
                        out.append(m)
        return out
