"""Drafters on SmolLM2-135M-Instruct on the device: held-out τ and end-to-end speedup over our AR.

    python benchmarks/drafters_h200.py --model SmolLM2.gguf --block 8=DIR8/drafter.safetensors \
        --block 16=DIR16/drafter.safetensors [--chat-prompts chat.jsonl] [--held-out 8]

The held-out prompts are the ones `specjax train-drafter` keeps out of training (the first
--held-out HumanEval prompts and the first --held-out chat prompts). For each block size B
(k = B - 1 drafts per round): n-gram, layer-skip (8 of 30 layers) and the trained block drafter,
batch 1, greedy, every output checked token for token against AR. Time per prompt is the engine's
prefill + decode time, best of two (compilation excluded; one warm-up generate per decoder first).
Writes $OUT/drafters_h200.json and prints a short table last.
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
from specjax.drafters.block_train import load_block_drafter  # noqa: E402
from specjax.drafters.factory import make_drafter  # noqa: E402
from specjax.engine import Decoder, pooled_tau  # noqa: E402
from specjax.models.loading import load_model  # noqa: E402
from specjax.prompts import humaneval_prompts, read_prompts_file, sharegpt_prompts  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save(results: dict):
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafters_h200.json").write_text(json.dumps(results, indent=1))


def run_set(decoder: Decoder, prompts: list[list[int]], repeats: int = 2):
    """(tokens, seconds, result) per prompt; seconds: the best of `repeats` runs."""
    decoder.generate(prompts[:1])  # warm-up (compilation is excluded from the engine's timings anyway)
    out = []
    for p in prompts:
        runs = [decoder.generate([p]) for _ in range(repeats)]
        out.append((runs[0].tokens[0], min(r.prefill_s + r.decode_s for r in runs), runs[0]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--block", action="append", default=[], metavar="B=PATH",
                    help="a trained block drafter for block size B (repeatable)")
    ap.add_argument("--chat-prompts", help="chat prompts file (default: ShareGPT's)")
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layer-skip", type=int, default=8, help="layers the layer-skip drafter keeps")
    ap.add_argument("--kernels", default="auto", help="engine kernels: auto (XLA) | pallas (GPU: the same "
                    "numerics at every width, so verify steps reproduce AR steps bit for bit)")
    args = ap.parse_args()
    target = load_model(args.model, dtype=args.dtype)
    tok = target.tokenizer
    held = args.held_out
    chat = read_prompts_file(args.chat_prompts)[:held] if args.chat_prompts else sharegpt_prompts(held)
    sets = {"humaneval": [tok.encode(t) for t in humaneval_prompts(held)],
            "sharegpt": [tok.encode(t) for t in chat]}
    bucket = prompt_bucket(max(len(p) for ps in sets.values() for p in ps))
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_tokens=tok.eos_ids)
    results = {"meta": {"model": args.model, "dtype": args.dtype, "kernels": args.kernels, "held_out": held, "bucket": bucket,
                        "max_new_tokens": args.max_new_tokens, "jax": jax.__version__,
                        "device": jax.devices()[0].device_kind,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}}
    eng = dict(min_prompt_bucket=bucket, kernels=args.kernels)
    ar = {name: run_set(Decoder(target.cfg, target.params, gen, **eng), ps)
          for name, ps in sets.items()}
    for name, rows in ar.items():
        toks = sum(len(t) for t, _, _ in rows)
        results[f"ar/{name}"] = {"tokens": toks, "seconds": sum(s for _, s, _ in rows)}
        log("AR", name, results[f"ar/{name}"])
    for spec in args.block:
        b, path = spec.split("=", 1)
        k = int(b) - 1
        drafters = {"ngram": make_drafter("ngram", target, k),
                    f"layerskip:{args.layer_skip}": make_drafter(f"layerskip:{args.layer_skip}", target, k),
                    "block": load_block_drafter(path, target.params, target.cfg)}
        for dname, d in drafters.items():
            decoder = Decoder(target.cfg, target.params, gen, d, **eng)
            for name, ps in sets.items():
                rows = run_set(decoder, ps)
                exact = all(t == a for (t, _, _), (a, _, _) in zip(rows, ar[name]))
                secs = sum(s for _, s, _ in rows)
                entry = {"k": k, "tau": pooled_tau([r for _, _, r in rows]), "seconds": secs,
                         "speedup_over_ar": results[f"ar/{name}"]["seconds"] / secs, "token_exact": exact}
                results[f"B{b}/{dname}/{name}"] = entry
                save(results)  # partial results survive a time limit
                log(f"B={b}", dname, name, {k_: round(v, 3) if isinstance(v, float) else v
                                            for k_, v in entry.items()})
    save(results)
    print(f"\n{'block':>5} {'drafter':>12} {'set':>10} {'tau':>6} {'speedup':>8} exact")
    for key, e in results.items():
        if key.startswith("B"):
            b, dname, name = key.split("/")
            print(f"{b[1:]:>5} {dname:>12} {name:>10} {e['tau']:6.2f} {e['speedup_over_ar']:7.2f}x {e['token_exact']}")


if __name__ == "__main__":
    main()
