"""Sizing probe for the device search: what a measurement costs on this device, with a random-weight
target of SmolLM2-135M's shape (same compile and step costs as the real weights).

    python benchmarks/search_probe.py [--out DIR]

Times: the evaluator's start (AR references), one compile, N compiles in parallel (`prepare`), one
measurement, and the cost model's fit. Writes DIR/search_probe.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from specjax.costmodel.hardware import NOMINAL, current_device_name, fit_to_target
from specjax.models.config import ModelConfig
from specjax.models.loading import LoadedModel
from specjax.models.params import init_random_params
from specjax.search.evaluate import Evaluator

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0, dtype="bfloat16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/probe"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": current_device_name(), "jax": jax.__version__}
    cfg = ModelConfig(**SMOLLM2)
    params = init_random_params(cfg, jax.random.PRNGKey(0), scale=0.02)
    target = LoadedModel("random-smollm2-shape", cfg, params, None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(100, 250, args.prompts)]

    t = time.perf_counter()
    dev = fit_to_target(NOMINAL.get(res["device"], NOMINAL["h200"]), cfg, params)
    res["fit_s"] = time.perf_counter() - t
    res["fit"] = {"step_overhead_us": dev.step_overhead * 1e6, "layer_overhead_us": dev.layer_overhead * 1e6,
                  "flops_T": dev.flops / 1e12}
    t = time.perf_counter()
    ev = Evaluator(target, prompts, args.tokens, dev, res["device"])
    res["evaluator_start_s"] = time.perf_counter() - t

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    one = {"drafter.kind": "ngram", "drafter.k": 4, "drafter.ngram_max_n": 3}
    res["one_prepare_s"] = timed(lambda: ev.prepare([one, {"drafter.kind": "none"}], threads=1))
    many = [{"drafter.kind": "ngram", "drafter.k": k, "drafter.ngram_max_n": 2} for k in range(1, args.parallel // 2 + 1)]
    many += [{"drafter.kind": "layerskip", "drafter.k": k, "drafter.layers": 8} for k in range(1, args.parallel // 2 + 1)]
    res["parallel_configs"] = len(many)
    res["parallel_prepare_s"] = timed(lambda: ev.prepare(many, threads=args.parallel))
    for name, c in (("ar", {"drafter.kind": "none"}), ("ngram4", one), ("layerskip8_k2", {"drafter.kind": "layerskip", "drafter.k": 2, "drafter.layers": 8})):
        t = time.perf_counter()
        m = ev.gate(ev.measure(c, runs=3)[0])
        res[f"measure_{name}_s"] = time.perf_counter() - t
        res[f"{name}_tok_s"] = m.tokens_per_s
        res[f"{name}_step_ms"] = m.decode_s / max(m.steps, 1) * 1e3
        res[f"{name}_run_s"] = m.run_s
    (out / "search_probe.json").write_text(json.dumps(res, indent=1))
    for k, v in res.items():
        print(f"{k:28} {v if not isinstance(v, float) else round(v, 4)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
