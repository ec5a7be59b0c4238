"""`specjax bench [CONFIG.yaml]`: the benchmark protocol on real prompt sets (docs/design/bench.md)."""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path

from specjax.errors import ConfigError
from specjax.provenance import code_commit


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark decoding methods on five real prompt sets, lossless-gated")
    b.add_argument("config", nargs="?", help="bench config YAML (benchmarks/bench_*.yaml); default: a small CPU run")
    b.add_argument("--out", default="bench_out", help="directory for bench.json, bench.md, bench.png")
    b.add_argument("--sets", help="comma-separated prompt sets (overrides the config's)")
    b.add_argument("--prompts", type=int, help="prompts per set (overrides the config's)")
    b.add_argument("--max-new-tokens", type=int)
    b.add_argument("--repeats", type=int)
    b.add_argument("--peers", help="comma-separated: transformers_ar, transformers_prompt_lookup, "
                                   "transformers_early_exit:LAYERS ('none': off)")
    b.add_argument("--export-prompts", metavar="FILE",
                   help="write the config's prompt sets to FILE (checksummed JSON) and stop: for a machine "
                        "without the data packages")
    b.add_argument("--prompts-from", metavar="FILE", help="read the prompt sets from a file --export-prompts wrote")
    b.add_argument("--deadline-s", type=float,
                   help="start no (set, batch) unit after this many seconds; the report lists those skipped")
    b.add_argument("--finish-by-s", type=float,
                   help="skip a (set, batch) unit too when the last unit of its batch size, run again, would "
                        "end after this many seconds (a device call's limit never cuts a unit off)")
    b.add_argument("--resume", metavar="BENCH_JSON",
                   help="run only the (set, batch) units a partial bench.json of the same config has no rows "
                        "for, and write it joined with them to --out (a run split over device calls)")
    b.add_argument("--merge", nargs="+", metavar="BENCH_JSON",
                   help="merge bench.json files of one config run in parts (by sets) into --out, and stop")
    b.add_argument("--compile-cache", metavar="DIR",
                   help="keep compiled programs in DIR (JAX's persistent cache): the parts of a run split over "
                        "calls on one machine compile each decoder once")
    b.add_argument("--memory", default="memory_store",
                   help="memory store the config's memory methods (searched configs) read their records from")
    b.set_defaults(func=cmd_bench)


def _method_as_yaml(m) -> dict:
    """A Method as its YAML mapping: the name and every field set away from its default."""
    out = {"name": m.name}
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if f.name != "name" and value != f.default:
            out[f.name] = dict(value) if f.name in ("memory", "mechanisms") else value
    return out


def enable_compile_cache(directory: str) -> None:
    """JAX's persistent compilation cache in `directory`, for every program however quick to
    compile (a bench's decoders are many programs of a few seconds each)."""
    import jax
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cmd_bench(args) -> int:
    import jax

    from specjax.bench.config import BenchConfig, bench_config_from_dict, load_bench_config
    from specjax.bench.prompt_sets import export_prompt_sets, read_prompt_file
    from specjax.bench.protocol import merge_results, resume_result, run_bench
    from specjax.bench.report import markdown, write_report
    from specjax.models.loading import load_model

    if args.merge:
        from specjax.atomic import read_json_checked
        try:
            result = merge_results([read_json_checked(p) for p in args.merge])
        except ValueError as e:
            raise ConfigError(f"--merge {' '.join(args.merge)}: {e}") from None
        paths = write_report(result, args.out)
        print(markdown(result) + "wrote " + ", ".join(str(p) for p in paths.values()))
        return 0

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
        raw["sets"], raw["methods"] = dict(cfg.sets), [_method_as_yaml(m) for m in cfg.methods]
        raw["batch_sizes"], raw["peers"] = list(cfg.batch_sizes), list(cfg.peers)
        cfg = bench_config_from_dict({**raw, **overrides}, "command line")
    if args.export_prompts:
        export_prompt_sets(cfg.sets, args.export_prompts)
        print(f"wrote {args.export_prompts}: " + ", ".join(f"{n} ({k} prompts)" for n, k in cfg.sets))
        return 0
    previous = only = None
    if args.resume:
        from specjax.atomic import read_json_checked
        from specjax.bench.protocol import units_to_resume
        previous, only = units_to_resume(read_json_checked(args.resume), cfg)
        if not only:
            raise ConfigError(f"--resume {args.resume}: every unit of that run has rows; there is nothing to resume")
    exported = read_prompt_file(args.prompts_from) if args.prompts_from else None
    commit = code_commit()  # the code that runs: read before the run, which can outlast a commit
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "commit": commit}
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    if cfg.matmul_precision:
        jax.config.update("jax_default_matmul_precision", cfg.matmul_precision)
    meta["matmul_precision"] = jax.config.jax_default_matmul_precision
    model = load_model(cfg.model, cfg.dtype)
    deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
    finish_by = None if args.finish_by_s is None else time.monotonic() + args.finish_by_s

    def joined(r):
        r = dict(r, meta=meta)
        if previous is None:
            return r
        try:
            return resume_result(previous, r)
        except ValueError as e:
            raise ConfigError(f"--resume {args.resume}: {e}") from None
    from specjax.memory.store import MemoryStore
    result = run_bench(model, cfg, progress=lambda s: print(s, flush=True), exported=exported, deadline=deadline,
                       partial=lambda r: write_report(joined(r), args.out), only_units=only,
                       store=MemoryStore(args.memory), finish_by=finish_by)
    result = joined(result)
    paths = write_report(result, args.out)
    print("\n" + markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
