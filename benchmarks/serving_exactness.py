"""Why does the served row fail the forcing gate on the GPU when its CPU tests pass at tolerance 0?
(the H200 bench 2026-12-07 and the H100 bench of the same evening: 1-3 of 128 positions a prompt.)

    PYTHONPATH=/tmp/site:$PWD python -u benchmarks/serving_exactness.py --prompts /tmp/stash/prompts_h200.json

SmolLM2 bf16 on our kernels, HumanEval prompts at batch 1:
1. the prompt's K/V as the serving engine's admission writes them into its pages vs the Decoder's
   shared prompt program (`prompt_pass`), per layer: elements that differ, largest difference;
2. token forcing of the serving engine against the Decoder's AR for plain AR (no drafter) and the
   n-gram drafter, attention over views (xla) and the paged kernel (pallas), one device step a
   call (small compiles).
A difference in 1 with none of the kernels' rows involved points at the prefill program (XLA's
fusion of the elementwise ops around our kernels differs between programs); mismatches in 2 with
none in 1 point at the verify step. JSON to $OUT/serving_exactness.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax.numpy as jnp  # noqa: E402

from specjax.bench.prompt_sets import read_prompt_file  # noqa: E402
from specjax.decoding.sequences import GenerationConfig, prompt_bucket, prompt_pass  # noqa: E402
from specjax.drafters.ngram import NgramDrafter  # noqa: E402
from specjax.engine import Decoder  # noqa: E402
from specjax.forcing import check_token_forcing  # noqa: E402
from specjax.models.loading import load_model  # noqa: E402
from specjax.serving.decoder import ServingDecoder  # noqa: E402
from specjax.serving.state import ServingOptions  # noqa: E402

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def prefill_diff(dec, sdec, prompt):
    """Per layer (differing elements, max |difference|) between the engine's paged prompt K/V
    and the Decoder's prompt program's, over the prompt's positions."""
    P = prompt_bucket(len(prompt))
    padded = jnp.asarray([prompt + [0] * (P - len(prompt))], jnp.int32)
    cache, _, _ = prompt_pass(dec.params, dec.cfg, padded, jnp.asarray([len(prompt)], jnp.int32))
    engine = sdec.engine([prompt])
    engine.submit(prompt, 1)
    engine.run()  # a fresh engine's first request holds pages 1, 2, ... in order
    ps = engine.page_size
    n = -(-len(prompt) // ps)
    out = []
    for layer in range(len(cache.k)):
        row = []
        for ref, pool in ((cache.k[layer][0], engine.state.cache.k[layer]), (cache.v[layer][0], engine.state.cache.v[layer])):
            got = np.asarray(pool[1:1 + n].reshape((n * ps,) + pool.shape[2:])[:len(prompt)], np.float32)
            want = np.asarray(ref[:len(prompt)], np.float32)
            row.append((int(np.sum(got != want)), float(np.max(np.abs(got - want)))))
        out.append({"k": row[0], "v": row[1]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--kernels", default="pallas")
    args = ap.parse_args()
    model = load_model("smollm2-135m", "bfloat16")
    prompts = [model.tokenizer.encode(t) for t in read_prompt_file(args.prompts)["humaneval"][:args.n]]
    gen = GenerationConfig(max_new_tokens=args.max_new)
    dec = Decoder(model.cfg, model.params, gen, kernels=args.kernels)
    result = {"prefill": [], "forcing": {}}
    attention = "pallas" if args.kernels == "pallas" else "interpret"
    sdec = ServingDecoder(model.cfg, model.params, gen, None, num_slots=1, kernels=args.kernels,
                          options=ServingOptions(steps_per_call=1))
    for p in prompts:
        d = prefill_diff(dec, sdec, p)
        bad = [i for i, x in enumerate(d) if x["k"][0] or x["v"][0]]
        log(f"prompt of {len(p)} tokens: prefill K/V differ in {len(bad)} of {len(d)} layers; first: "
            f"{d[bad[0]] if bad else '-'}")
        result["prefill"].append(d)
    reference = [dec.generate([p]) for p in prompts]
    for label, drafter, att in (("ar/views", None, "xla"), ("ar/paged", None, attention),
                                ("ngram4/views", NgramDrafter(k=4), "xla"), ("ngram4/paged", NgramDrafter(k=4), attention)):
        s = ServingDecoder(model.cfg, model.params, gen, drafter, num_slots=1, kernels=args.kernels,
                           options=ServingOptions(steps_per_call=1, attention=att))
        if drafter is None:  # forcing needs a drafter: compare the free-running tokens
            firsts = []
            for p, r in zip(prompts, reference):
                got, want = s.generate([p]).tokens[0], r.tokens[0]
                firsts.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
            result["forcing"][label] = {"first_difference": firsts}
            log(f"{label}: first differing position per prompt (None: equal): {firsts}")
            continue
        reports = [check_token_forcing(s, [p], r, 0.0) for p, r in zip(prompts, reference)]
        mism = sum(len(r.failures) for r in reports)
        result["forcing"][label] = {"mismatches": mism, "summaries": [r.summary() for r in reports]}
        log(f"{label}: {mism} mismatching positions; {reports[0].summary()}")
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_exactness.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
