"""The search on a real device, against random search and Optuna TPE, plus cost-model fidelity.

    python benchmarks/search_h200.py [--spec search_specs/h200.yaml] [--out DIR]

1. `specjax search SPEC` in full (the spec's budget): stock and found speedup over AR, measurements.
2. Random search and Optuna TPE (batched ask/tell, the search's batch size) with the same number of
   measurements as the search used after its AR baseline, on the same evaluator (same target, prompts,
   clock, floor and forcing gates). Each method's configs are measured fresh.
3. A final side-by-side measurement, interleaved: AR, stock and every method's best.
4. Cost-model fidelity over every distinct config measured above with a trustworthy time (validated,
   or refused by token forcing only; topped up with random configs to --min-fidelity): median relative error and Spearman of predicted vs measured tok/s.
   The cost model is the search's: fitted to the target and to the AR baseline, acceptance from the
   search's pilots; the AR config is a calibration point and is left out.

Writes DIR/search_bench.json (and the search's own report under DIR/search); prints a table last.
Rerun by the benchmarks issue on the full mechanism space (pass its spec with --spec).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from specjax.costmodel.model import predict
from specjax.search.evaluate import Evaluator, cost_inputs
from specjax.provenance import code_commit
from specjax.search.loop import AR_CONFIG, config_key
from specjax.search.plots import median_relative_error, spearman
from specjax.search.run import run_search
from specjax.search.spec import load_spec


def log(msg: str):
    print(msg, flush=True)


def distinct_valid(spec, draw, n: int, exclude=(), tries: int = 10000) -> list[dict]:
    seen, out = {config_key(c) for c in exclude}, []
    for _ in range(tries):
        if len(out) == n:
            break
        c = spec.canonical(draw())
        if spec.is_valid(c) and config_key(c) not in seen:
            seen.add(config_key(c))
            out.append(c)
    return out


def random_search(spec, ev: Evaluator, budget: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    configs = distinct_valid(spec, lambda: spec.random_config(rng), budget)
    results = ev.evaluate_many([(c, spec.budget.runs, None) for c in configs])
    return [row("random", m) for m, _ in results]


def suggest(trial, spec) -> dict:
    """Define-by-run: only active parameters are suggested, so TPE sees the conditional space."""
    config: dict = {}
    for name, p in spec.space.items():
        if not p.active(config):
            continue
        if p.kind == "int" and not p.values and p.low is not None:
            config[name] = trial.suggest_int(name, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        elif p.kind == "float" and not p.values and p.low is not None:
            config[name] = trial.suggest_float(name, p.low, p.high, step=p.step, log=p.log)
        else:
            config[name] = trial.suggest_categorical(name, list(p.grid()))
    return spec.canonical(config)


def tpe_search(spec, ev: Evaluator, budget: int, seed: int, batch: int) -> list[dict]:
    import warnings

    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # group=True
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                         n_startup_trials=max(batch, budget // 4))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    done: dict[str, float] = {}
    rows = []
    for _ in range(50 * budget):  # repeats cost no measurement; bound the asking anyway
        if len(rows) >= budget:
            break
        trials = [study.ask() for _ in range(min(batch, budget - len(rows)))]
        configs = [suggest(t, spec) for t in trials]
        fresh = []
        for c in configs:
            if spec.is_valid(c) and config_key(c) not in done and config_key(c) not in map(config_key, fresh):
                fresh.append(c)
        for m, _ in ev.evaluate_many([(c, spec.budget.runs, None) for c in fresh]):
            done[config_key(m.config)] = m.tokens_per_s if m.valid else 0.0
            rows.append(row("tpe", m))
        for t, c in zip(trials, configs):
            study.tell(t, done.get(config_key(c), 0.0) if spec.is_valid(c) else 0.0)
    return rows


def row(method: str, m) -> dict:
    return {"method": method, "config": m.config, "tokens_per_s": m.tokens_per_s, "tau": m.tau,
            "rejected": m.rejected, "device": m.device}


def predicted(ev: Evaluator, profiles: dict, configs: list[dict]) -> list[float]:
    profiles = {k: np.asarray(v) for k, v in profiles.items()}
    out = []
    for c in configs:  # one at a time: each config's own cache size
        inputs = cost_inputs([c], profiles)
        out.append(float(predict(ev.dims(int(max(inputs["k"].max(), 1))), ev.device, **inputs)["tokens_per_s"][0]))
    return out


def best(rows: list[dict]) -> dict | None:
    valid = [r for r in rows if r["rejected"] is None]
    return max(valid, key=lambda r: r["tokens_per_s"], default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="search_specs/h200.yaml")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/search_bench"))
    ap.add_argument("--min-fidelity", type=int, default=30)
    ap.add_argument("--final-runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--search-only", action="store_true",
                    help="the search and the final interleaved run (AR, stock, found) only: no random "
                         "search, TPE or fidelity top-up (a second spec sharing a device call)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = load_spec(args.spec)
    result: dict = {"spec": args.spec, "commit": code_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save():
        (out / "search_bench.json").write_text(json.dumps(result, indent=1))

    captured = {}

    def factory(*a, **kw):  # keep the search's evaluator: the baselines reuse it (and its compiles)
        captured["ev"] = Evaluator(*a, **kw)
        return captured["ev"]

    t = time.monotonic()
    state = run_search(args.spec, output=str(out / "search"), memory_dir=str(out / "memory"), progress=log,
                       evaluator_factory=factory)
    ev = captured["ev"]
    ar = state.ar["tokens_per_s"]
    budget = state.measurements - 1  # everything after the shared AR baseline: pilots, stock, re-measures
    search_rows = [dict(row("search", _as_m(e["measurement"])), round=e["round"]) for e in state.evaluated.values()]
    result["device"] = ev.device_name
    result["cost_device"] = dataclasses.asdict(ev.device)
    result["search"] = {"seconds": time.monotonic() - t, "measurements": state.measurements, "budget": budget,
                        "ar_tokens_per_s": ar, "stock": _brief(state.stock, ar), "found": _brief(state.incumbent, ar),
                        "rounds": state.history, "evaluated": search_rows}
    save()
    log(f"search: stock {state.stock['tokens_per_s'] / ar:.2f}x, found {state.incumbent['tokens_per_s'] / ar:.2f}x, "
        f"{state.measurements} measurements; baselines get {budget} each")

    baselines = () if args.search_only else (
        ("random", lambda: random_search(spec, ev, budget, args.seed)),
        ("tpe", lambda: tpe_search(spec, ev, budget, args.seed, spec.budget.measure_per_round)))
    for name, fn in baselines:
        t = time.monotonic()
        rows = fn()
        b = best(rows)
        result[name] = {"seconds": time.monotonic() - t, "measurements": len(rows), "best": b, "evaluated": rows}
        save()
        log(f"{name}: {len(rows)} measured, best {b['config'] if b else None} "
            f"{(b['tokens_per_s'] / ar) if b else 0:.2f}x (own run)")

    # cost-model fidelity over every distinct config with a trustworthy time: validated ones, and ones
    # the forcing gate refused (that gate judges tokens, not the clock); floor-gate refusals are
    # timing bugs and crashes have no time, so those stay out
    if args.search_only:
        return final_word(args, result, save, ev, state, search_rows, extra=[])

    def timed_ok(r):
        return r["rejected"] is None or r["rejected"].startswith("token forcing")
    measured: dict[str, dict] = {}
    for r in search_rows + result["random"]["evaluated"] + result["tpe"]["evaluated"]:
        if timed_ok(r) and r["config"] != AR_CONFIG:
            measured.setdefault(config_key(r["config"]), r)
    extra = []
    rng = random.Random(args.seed + 1)
    seen = [r["config"] for r in search_rows + result["random"]["evaluated"] + result["tpe"]["evaluated"]]
    while len(measured) < args.min_fidelity:  # top up with fresh random configs
        more = distinct_valid(spec, lambda: spec.random_config(rng), args.min_fidelity - len(measured),
                              exclude=seen + [AR_CONFIG])
        if not more:
            break
        seen += more
        new = [row("fidelity", m) for m, _ in ev.evaluate_many([(c, spec.budget.runs, None) for c in more])]
        extra += new
        for r in new:
            if timed_ok(r):
                measured.setdefault(config_key(r["config"]), r)
    rows = list(measured.values())
    pred = predicted(ev, state.profiles, [r["config"] for r in rows])
    meas = [r["tokens_per_s"] for r in rows]
    ok = [i for i, r in enumerate(rows) if r["rejected"] is None]
    result["fidelity"] = {"configs": len(rows), "median_relative_error": median_relative_error(pred, meas),
                          "spearman": spearman(pred, meas), "extra_measured": len(extra),
                          "validated_only": {"configs": len(ok),
                                             "median_relative_error": median_relative_error([pred[i] for i in ok], [meas[i] for i in ok]),
                                             "spearman": spearman([pred[i] for i in ok], [meas[i] for i in ok])},
                          "mean_signed_error": float(np.mean((np.array(pred) - np.array(meas)) / np.array(meas))),
                          "points": [{"config": r["config"], "method": r["method"], "predicted": p,
                                      "measured": r["tokens_per_s"], "forcing_rejected": r["rejected"] is not None}
                                     for r, p in zip(rows, pred)],
                          "extra": extra}
    save()
    return final_word(args, result, save, ev, state, search_rows, extra)


def final_word(args, result, save, ev, state, search_rows, extra) -> int:
    """Everything side by side, interleaved, on one clock; then the printed table."""
    finals = {"ar": AR_CONFIG, "stock": state.stock["config"], "search": state.incumbent["config"]}
    for name in ("random", "tpe"):
        if result.get(name, {}).get("best"):
            finals[name] = result[name]["best"]["config"]
    ms = ev.measure_interleaved(list(finals.values()), args.final_runs)
    ar_final = ms[0].tokens_per_s
    result["final"] = {name: {"config": c, "tokens_per_s": m.tokens_per_s, "speedup": m.tokens_per_s / ar_final,
                              "tau": m.tau, "runs": m.runs} for (name, c), m in zip(finals.items(), ms)}
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()

    if "fidelity" in result:
        f = result["fidelity"]
        v = f["validated_only"]
        log(f"\ncost-model fidelity on {ev.device_name}: {f['configs']} configs, median relative error "
            f"{f['median_relative_error'] * 100:.1f}%, Spearman {f['spearman']:.3f}, mean signed error "
            f"{f['mean_signed_error'] * 100:+.1f}% (validated only: {v['configs']}, "
            f"{v['median_relative_error'] * 100:.1f}%, {v['spearman']:.3f})")
    others = [r for name in ("random", "tpe") for r in result.get(name, {}).get("evaluated", [])]
    gated = sum(1 for r in search_rows + others + extra
                if r["rejected"] and r["rejected"].startswith("token forcing"))
    log(f"token forcing refused {gated} measured configs")
    log(f"{'method':8} {'measurements':>12} {'tok/s':>9} {'speedup':>8}  config   (final interleaved run, {ev.device_name})")
    for name, v in result["final"].items():
        n = {"search": state.measurements, "random": result.get("random", {}).get("measurements"),
             "tpe": result.get("tpe", {}).get("measurements")}.get(name, "")
        log(f"{name:8} {str(n):>12} {v['tokens_per_s']:9.1f} {v['speedup']:7.2f}x  {json.dumps(v['config'])}")
    return 0


def _as_m(d: dict):
    from specjax.search.evaluate import Measurement
    return Measurement(**d)


def _brief(m: dict, ar: float) -> dict:
    return {"config": m["config"], "tokens_per_s": m["tokens_per_s"], "speedup": m["tokens_per_s"] / ar,
            "rejected": m["rejected"]}


if __name__ == "__main__":
    sys.exit(main())
