"""`specjax bench [CONFIG.yaml]`: the benchmark protocol on real prompt sets (docs/design/bench.md)."""

from __future__ import annotations

import dataclasses
import datetime
import subprocess
from pathlib import Path


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark decoding methods on five real prompt sets, lossless-gated")
    b.add_argument("config", nargs="?", help="bench config YAML (benchmarks/bench_*.yaml); default: a small CPU run")
    b.add_argument("--out", default="bench_out", help="directory for bench.json, bench.md, bench.png")
    b.add_argument("--sets", help="comma-separated prompt sets (overrides the config's)")
    b.add_argument("--prompts", type=int, help="prompts per set (overrides the config's)")
    b.add_argument("--max-new-tokens", type=int)
    b.add_argument("--repeats", type=int)
    b.add_argument("--peers", help="comma-separated: transformers_ar, transformers_prompt_lookup ('none': off)")
    b.set_defaults(func=cmd_bench)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2], timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cmd_bench(args) -> int:
    import jax

    from specjax.bench.config import BenchConfig, bench_config_from_dict, load_bench_config
    from specjax.bench.protocol import run_bench
    from specjax.bench.report import markdown, write_report
    from specjax.models.loading import load_model

    cfg = load_bench_config(args.config) if args.config else BenchConfig(deployment="cpu-default")
    overrides = {}
    if args.sets or args.prompts:
        names = args.sets.split(",") if args.sets else [n for n, _ in cfg.sets]
        counts = dict(cfg.sets)
        overrides["sets"] = {n: args.prompts or counts.get(n, 4) for n in names}
    if args.max_new_tokens:
        overrides["max_new_tokens"] = args.max_new_tokens
    if args.repeats:
        overrides["repeats"] = args.repeats
    if args.peers:
        overrides["peers"] = [] if args.peers == "none" else args.peers.split(",")
    if overrides:  # re-validated as a whole, so an override gets the same field-named errors
        raw = dataclasses.asdict(cfg)
        raw["sets"], raw["methods"] = dict(cfg.sets), [
            {k: v for k, v in dataclasses.asdict(m).items() if v is not None} for m in cfg.methods]
        raw["batch_sizes"], raw["peers"] = list(cfg.batch_sizes), list(cfg.peers)
        cfg = bench_config_from_dict({**raw, **overrides}, "command line")
    commit = _commit()  # the code that runs: read before the run, which can outlast a commit
    model = load_model(cfg.model, cfg.dtype)
    result = run_bench(model, cfg, progress=lambda s: print(s, flush=True))
    result["meta"] = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                      "jax": jax.__version__, "commit": commit}
    paths = write_report(result, args.out)
    print("\n" + markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
