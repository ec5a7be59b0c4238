"""τ (tokens committed per target verify step) of chain vs tree verification at equal node
budgets, on SmolLM2-135M-Instruct with real prompts (HumanEval and ShareGPT). τ does not depend
on the hardware, so this runs anywhere (the CPU figures in docs/results/trees_tau.md); a verify
step's time against its node count is `benchmarks/trees_h200.py`'s job, and a deployment's speed
is τ over that time.

    python benchmarks/trees_tau.py [--prompts 6] [--max-new-tokens 64] [--dtype float32]

Drafters: the shipped block drafter (k = 7; trees: best-first) and n-gram (k = 7; trees: top-k
expansion of its chain). Budgets: the chain's k = 7 drafted nodes, and trees of 7, 16 and 32
drafted nodes (depth <= 7). Every output is checked token for token against AR.
Writes $OUT/trees_tau.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.decoding.sequences import GenerationConfig, prompt_bucket  # noqa: E402
from specjax.drafters.factory import make_drafter  # noqa: E402
from specjax.engine import Decoder, pooled_tau  # noqa: E402
from specjax.models.loading import load_model  # noqa: E402
from specjax.prompts import humaneval_prompts, sharegpt_prompts  # noqa: E402
from specjax.trees.builders import TreeSpec  # noqa: E402

K = 7
BUDGETS = (7, 16, 32)
BUILDER = {"block": "best_first", "ngram": "topk"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set (the block drafter's held-out ones)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    t0 = time.time()
    target = load_model(args.model, dtype=args.dtype)
    tok = target.tokenizer
    sets = {"humaneval": [tok.encode(t) for t in humaneval_prompts(args.prompts)],
            "sharegpt": [tok.encode(t) for t in sharegpt_prompts(args.prompts)]}
    bucket = prompt_bucket(max(len(p) for ps in sets.values() for p in ps))
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_tokens=tok.eos_ids)
    results = {"meta": {"model": args.model, "dtype": args.dtype, "prompts": args.prompts, "k": K,
                        "max_new_tokens": args.max_new_tokens, "jax": jax.__version__,
                        "device": jax.devices()[0].device_kind,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}}
    ar = {name: Decoder(target.cfg, target.params, gen, min_prompt_bucket=bucket).generate(ps).tokens
          for name, ps in sets.items()}
    for dname in ("block", "ngram"):
        drafter = make_drafter(dname, target, K)
        variants = {"chain": None} | {f"tree{n}": TreeSpec.budget(BUILDER[dname], n, K) for n in BUDGETS}
        for vname, tree in variants.items():
            decoder = Decoder(target.cfg, target.params, gen, drafter, min_prompt_bucket=bucket, tree=tree)
            for name, ps in sets.items():
                res = decoder.generate(ps)
                entry = {"tau": pooled_tau([res]), "nodes": K if tree is None else tree.nodes,
                         "builder": "chain" if tree is None else tree.builder,
                         "token_exact": res.tokens == ar[name], "rounds": int(res.rounds.sum())}
                results[f"{dname}/{vname}/{name}"] = entry
                print(f"[{time.time() - t0:6.0f}s] {dname} {vname} {name} {entry}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "trees_tau.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'drafter':>8} {'verify':>8} {'set':>10} {'tau':>6} exact")
    for key, e in results.items():
        if key != "meta":
            d, v, s = key.split("/")
            print(f"{d:>8} {v:>8} {s:>10} {e['tau']:6.2f} {e['token_exact']}")


if __name__ == "__main__":
    main()
