"""SmolLM2 AR on our kernels with the old and the new default GEMM configs for small matrices
(`pallas_kernels.skinny_gemm.default_config`, 2026-12-07), XLA's GEMMs beside them, one process.

    PYTHONPATH=/tmp/site:$PWD python -u benchmarks/small_gemm_ab.py --prompts /tmp/stash/prompts_h200.json

Each variant: a Decoder over the same bf16 SmolLM2, 4 HumanEval prompts at batch 1, exactly
--max-new tokens each, a warm-up pass, then --repeats timed passes (median tok/s); the 12-bit
(LH12) target under both configs too. The old and new bf16 runs differ in numerics (split_k), so
their tokens may part at a near-tie; each is compared with its own 12-bit twin (must be equal).
JSON to $OUT/small_gemm_ab.json; a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pallas_kernels.skinny_gemm as sg  # noqa: E402
import specjax.models.kernel_params as kp  # noqa: E402
from specjax.bench.prompt_sets import read_prompt_file  # noqa: E402
from specjax.decoding.sequences import GenerationConfig  # noqa: E402
from specjax.engine import Decoder  # noqa: E402
from specjax.models.loading import load_model  # noqa: E402

NEW = sg.default_config


def old_default(shape, fmt="bf16", block_k=64):
    """The rule before 2026-12-07: >= 4 K steps a program, 256 columns a program for the split."""
    k, n = shape
    grid_n = -(-(-(-n // sg.STRIPES)) // (256 // sg.STRIPES))
    steps = max(1, -(-k // block_k))
    return sg.GemmConfig(block_k=block_k, split_k=sg._split(steps, grid_n, 4), **sg.DEFAULT_SPEED[fmt])


def run(cfg, params, prompts, gen, repeats, **kw):
    dec = Decoder(cfg, params, gen, **kw)
    t = time.perf_counter()
    for p in prompts:  # every prompt's shape compiled before the timed passes
        dec.generate([p])
    compile_s = time.perf_counter() - t
    rates, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = [dec.generate([p]).tokens[0] for p in prompts]
        rates.append(sum(len(o) for o in out) / (time.perf_counter() - t))
    return statistics.median(rates), out, compile_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernels", default="pallas", help="interpret: a CPU smoke run (with --layers 2)")
    ap.add_argument("--layers", type=int, default=0, help="only the first N layers (smoke runs)")
    ap.add_argument("--formats", default="bf16,lh12", help="bf16: skip the 12-bit runs (their first call compiles long)")
    args = ap.parse_args()
    model = load_model("smollm2-135m", "bfloat16")
    cfg, params = model.cfg, model.params
    if args.layers:
        from specjax.models.params import truncate_layers
        cfg, params = cfg.with_layers(args.layers), truncate_layers(params, args.layers)
    texts = read_prompt_file(args.prompts)["humaneval"][:4]
    prompts = [model.tokenizer.encode(t) for t in texts]
    gen = GenerationConfig(max_new_tokens=args.max_new)
    rows, tokens = {}, {}
    variants = [("xla", None, dict(kernels="xla"))]
    for label, rule in (("old", old_default), ("new", NEW)):
        variants.append((f"{label}_bf16", rule, dict(kernels=args.kernels)))
        if "lh12" in args.formats:
            variants.append((f"{label}_lh12", rule, dict(kernels=args.kernels, weights_format={
                g: "lh12" for g in ("attn", "mlp", "head")})))
    for name, rule, kw in variants:
        if rule is not None:
            kp.default_config = rule  # what prepare_kernel_params reads
        rate, out, compile_s = run(cfg, params, prompts, gen, args.repeats, **kw)
        rows[name], tokens[name] = {"tok_s": rate, "first_call_s": compile_s}, out
        print(f"{name}: {rate:.1f} tok/s (first call {compile_s:.0f} s)", flush=True)
    for label in ("old", "new"):
        if f"{label}_lh12" in rows:
            rows[f"{label}_lh12"]["equal_to_bf16"] = tokens[f"{label}_lh12"] == tokens[f"{label}_bf16"]
    rows["new_bf16"]["equal_to_old"] = tokens["new_bf16"] == tokens["old_bf16"]
    import jax
    meta = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "commit": os.environ.get("SPECJAX_COMMIT", "unknown"), "max_new": args.max_new, "prompts": 4}
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "small_gemm_ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = rows["old_bf16"]["tok_s"]
    print("\n| variant | tok/s | vs old bf16 |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
