"""Batched serving on the device: throughput of the continuous-batching engine at several batch
sizes, AR vs stock speculative vs each batching mechanism added in turn vs all of them.

    python -u benchmarks/serving_h200.py --part 8b [--batches 1,8,32,64] [--deadline-s 540]
    python -u benchmarks/serving_h200.py --part smollm2 --gguf PATH [...]
    python -u benchmarks/serving_h200.py --smoke            # CPU, tiny model, seconds

8b: a Llama-3-8B-shaped target with random bf16 weights (a planted next-token rule keeps its
greedy path robust to reduction order: `planted`), random-token prompts, and acceptance
replayed from a real pair (SmolLM2-135M + n-gram k = 7 on HumanEval, the profile in
specjax/drafters/trained/): the replay drafter proposes the target's own greedy continuation,
corrupted per that profile, so its drafts are verified for real. smollm2: SmolLM2-135M-Instruct
(bf16) with its shipped trained block drafter (k = 7) on HumanEval prompts.

Per batch size B: 2B requests (at least 8) of `--max-new` tokens each, all submitted at once and
served B at a time; throughput = generated tokens / wall seconds of `engine.run()` (host loop
included: that is what mechanism 3 removes), after a warm-up run that compiles. Configurations:
AR (device-resident), stock (chain k = 7, padded, no budget, one host round trip per step), then at
`--ladder-batch` the mechanisms added one at a time (budget, packed, device-resident steps,
two-level), and at every B all of them. Admission prefills the requests admitted together in one
forward (`batched_prefill`); the "-prefill1" rungs at the ladder batch prefill one by one.
The budget is chosen (`choose_budget`) from the cost of a verify pass at each token count: measured first (`serving/profile.py`, the default) or as the
cost model prices it with the H200's read bandwidth and matmul rate (`--budget-from costmodel`,
what the 2026-12-04 results used). Every output is compared with AR's token for token (bf16 on a GPU: a
near-tie can flip; the count is reported, never hidden). JSON to $OUT/serving_h200_<part>.json
after every configuration; a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.costmodel.hardware import NOMINAL  # noqa: E402
from specjax.costmodel.model import ModelDims, predict  # noqa: E402
from specjax.decoding.sequences import GenerationConfig  # noqa: E402
from specjax.engine import Decoder  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.params import init_random_params  # noqa: E402
from specjax.serving import ServingEngine, ServingOptions  # noqa: E402
from specjax.serving.budget import choose_budget  # noqa: E402

T0 = time.time()
K = 7
PROFILE = Path(__file__).resolve().parents[1] / "specjax/drafters/trained/smollm2-135m-ngram7-humaneval.profile.json"


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def llama3_8b() -> ModelConfig:
    return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                       max_position_embeddings=8192, dtype="bfloat16")


def tiny() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=512)


def planted(cfg: ModelConfig, key):
    """Random bf16 weights of the full shape with a planted next-token rule: the layers' weights
    are small (scale 0.002) next to a unit-scale embedding, and the head maps each token's
    embedding to a fixed random successor, so the greedy choice has a margin of ~sqrt(D) logits.
    A plainly random target's top-2 logits sit within bf16 reduction noise of each other, and a
    verify pass's GEMMs round differently from an AR step's on the GPU: its greedy path would
    drift from the replayed reference within a few tokens (measured: 0/64 rows, tau 1.03). The
    planted rule keeps the path robust while every byte and FLOP of the step stays real."""
    k_params, k_embed, k_succ = jax.random.split(key, 3)
    params = init_random_params(cfg, k_params, scale=0.002)
    dtype = jax.numpy.dtype(cfg.dtype)
    embed = jax.random.normal(k_embed, (cfg.vocab_size, cfg.hidden_size), jax.numpy.float32).astype(dtype)
    succ = jax.random.permutation(k_succ, cfg.vocab_size)
    head = jax.numpy.zeros((cfg.hidden_size, cfg.vocab_size), dtype).at[:, succ].set(embed.T)
    return dataclasses.replace(params, embed=embed, lm_head=head)


def verify_cost(cfg, batch: int, slot_len: int):
    """Seconds of a verify pass over T flat tokens, per the cost model with H200 figures."""
    dims = dataclasses.replace(ModelDims.of(cfg, slot_len), batch=1)
    dev = NOMINAL["h200"]

    def seconds(tokens: int) -> float:
        width = tokens / batch  # per slot; the model's batch term prices B slots' KV
        p = predict(dataclasses.replace(dims, batch=batch), dev, [max(width - 1, 0)], [1], [0],
                    np.zeros((1, 32)), packed=[1], budget=[0], steps_per_call=[1], two_level_k1=[0])
        return float(p["component_time"][0, 0])
    return seconds


def configs(batch: int, budget: int, ladder: bool, only: set[str] | None = None
            ) -> list[tuple[str, ServingOptions | None, bool]]:
    """(name, options, speculative); `only`: keep just these names."""
    stock = ServingOptions()
    out = [("ar", ServingOptions(packed=True, steps_per_call=16), False), ("stock", stock, True)]
    if ladder:
        b = dataclasses.replace(stock, budget=budget)
        p = dataclasses.replace(b, packed=True)
        d = dataclasses.replace(p, steps_per_call=16)
        out += [("+budget", b, True), ("+packed", p, True), ("+device_loop", d, True)]
    all_on = ServingOptions(budget=budget, packed=True, steps_per_call=16, two_level_k1=2)
    out.append(("all", all_on, True))
    if jax.devices()[0].platform == "gpu":  # the ragged paged attention kernel in place of XLA's gather
        out.insert(1, ("ar+paged_kernel", dataclasses.replace(out[0][1], attention="pallas"), False))
        # the best ladder rung so far (two-level off) with the kernel
        out.append(("+device_loop+paged_kernel", dataclasses.replace(all_on, two_level_k1=None,
                                                                     attention="pallas"), True))
        out.append(("all+paged_kernel", dataclasses.replace(all_on, attention="pallas"), True))
        if ladder:  # admission one request per prefill forward, as before batched prefill
            out.append(("ar-prefill1", dataclasses.replace(out[0][1], batched_prefill=False), False))
            out.append(("+device_loop+paged_kernel-prefill1", dataclasses.replace(
                all_on, two_level_k1=None, attention="pallas", batched_prefill=False), True))
    if only:
        out = [c for c in out if c[0] in only]
    return out


def run_engine(cfg, params, drafter, prompts, max_new, batch, opts, slot_len, width, profile=False):
    engine = ServingEngine(cfg, params, drafter, num_slots=batch, slot_len=slot_len, page_size=16,
                           queue_len=batch, max_waiting=len(prompts) + 8, prompt_width=width, options=opts)
    for p in prompts[:batch]:  # warm-up: compiles this engine's call
        engine.submit(p, min(max_new, 4))
    engine.run()
    calls0, steps0 = engine.calls, engine.steps
    t = time.perf_counter()
    rids = [engine.submit(p, max_new) for p in prompts]
    results = engine.run()
    seconds = time.perf_counter() - t
    res = [results[r] for r in rids]
    rounds = sum(r.rounds for r in res)
    calls, steps = engine.calls - calls0, engine.steps - steps0  # the timed run's alone
    busy = None
    if profile:  # the same requests again under the profiler: device kernel time vs wall
        from specjax.profiling import by_name, device_kernel_events

        def again():
            for p in prompts:
                engine.submit(p, max_new)
            return engine.run()
        t = time.perf_counter()
        events = device_kernel_events(again)
        wall = time.perf_counter() - t
        names = by_name(events)
        busy = dict(wall_s=wall, kernel_s=sum(s for _, s in events), kernels=len(events),
                    top=[(k, c, s) for k, (c, s) in list(names.items())[:25]])
    return dict(profile=busy, tokens=sum(len(r.tokens) for r in res), seconds=seconds,
                tokens_per_s=sum(len(r.tokens) for r in res) / seconds,
                tau=sum(r.committed for r in res) / max(rounds, 1), calls=calls,
                steps=steps, outputs=[r.tokens for r in res])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["8b", "smollm2"], default="8b")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--batches", default="32,8,64,1")  # in order of importance (deadline)
    ap.add_argument("--ladder-batch", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="rerun each configuration under the profiler: device kernel time vs wall, top kernels")
    ap.add_argument("--configs", default=None,
                    help="comma-separated names to run (ar, stock, +budget, +packed, +device_loop, all, "
                         "+device_loop+paged_kernel, all+paged_kernel); default: all of them")
    ap.add_argument("--budget-from", choices=["profile", "costmodel"], default="profile",
                    help="price of a verify pass per token count: measured here (verify_profile) or "
                         "the cost model's H200 figures (the 2026-12-04 results used costmodel)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    part = "smoke" if args.smoke else args.part
    report = {"meta": {"part": part, "jax": jax.__version__, "device": str(jax.devices()[0]),
                       "date": time.strftime("%Y-%m-%d"), "k": K, "max_new_tokens": args.max_new},
              "runs": {}}
    rng = np.random.default_rng(0)
    n_prompts = max(2 * max(batches), 8)
    if part == "smollm2":
        from specjax.models.loading import load_model
        from specjax.prompts import humaneval_prompts
        model = load_model(args.gguf, dtype="bfloat16")
        cfg, params = model.cfg, model.params
        prompts = [model.tokenizer.encode(p)[:160] for p in humaneval_prompts(n_prompts)]
        from specjax.drafters.block_train import load_block_drafter
        from specjax.drafters.trained import drafter_path
        drafter = load_block_drafter(drafter_path("smollm2-135m", K + 1), params, cfg)
        report["meta"]["drafter"] = "trained block drafter (shipped, block 8)"
    else:
        cfg = tiny() if part == "smoke" else llama3_8b()
        params = planted(cfg, jax.random.PRNGKey(0))
        vocab = min(cfg.vocab_size, 32000)
        prompts = [rng.integers(0, vocab, int(rng.integers(32, 97))).tolist() for _ in range(n_prompts)]
        from specjax.drafters.ngram import NgramDrafter
        from specjax.drafters.replay import load_profile, replay_drafter
        alpha = load_profile(PROFILE)[:K]
        t = time.perf_counter()
        drafter = replay_drafter(NgramDrafter(k=K), cfg, params, prompts, args.max_new, alpha)
        log(f"replay references (AR over {len(prompts)} prompts) in {time.perf_counter() - t:.1f} s")
        report["meta"]["drafter"] = f"replayed acceptance ({PROFILE.name}, alpha {alpha}), n-gram network"
    width = max(len(p) for p in prompts)
    slot_len = -(-(width + args.max_new + K + 1) // 16) * 16
    if part == "smollm2":
        ar_ref = Decoder(cfg, params, GenerationConfig(max_new_tokens=args.max_new)).generate(prompts).tokens
    else:  # the replay drafter's references are AR's greedy continuations (k + 1 tokens longer)
        refs = np.asarray(drafter.refs)
        ar_ref = [refs[i, len(p):len(p) + args.max_new].tolist() for i, p in enumerate(prompts)]
    log(f"{part}: {len(prompts)} prompts (longest {width}), slot_len {slot_len}; AR reference done")
    from specjax.drafters.replay import load_profile
    alpha = load_profile(PROFILE if part != "smollm2" else PROFILE.with_name("smollm2-135m-block8.profile.json"))[:K]
    report["meta"]["budget_profile_alpha"] = alpha
    for batch in batches:
        if args.budget_from == "profile":
            from specjax.serving.profile import interpolate, verify_profile
            counts = sorted({batch * (1 + d) for d in range(K + 1)})
            prof = verify_profile(params, cfg, batch, slot_len, counts)
            report.setdefault("verify_profile", {})[f"B{batch}"] = prof
            price = interpolate(prof)
        else:
            price = verify_cost(cfg, batch, slot_len)
        budget = choose_budget(price, alpha, batch, K)
        report.setdefault("budget", {})[f"B{batch}"] = budget
        only = set(args.configs.split(",")) if args.configs else None
        for name, opts, spec in configs(batch, budget, batch == args.ladder_batch, only):
            key = f"B{batch}/{name}"
            if time.time() - T0 > args.deadline_s:
                log(f"deadline: skipping {key}")
                continue
            reqs = prompts[:max(2 * batch, 8)]
            try:
                r = run_engine(cfg, params, drafter if spec else None, reqs, args.max_new, batch, opts,
                               slot_len, width, profile=args.profile)
            except Exception as e:  # one failing configuration (a kernel that does not compile) is recorded
                report["runs"][key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
                log(f"{key}: FAILED {type(e).__name__}: {str(e)[:300]}")
                (out_dir / f"serving_h200_{part}.json").write_text(json.dumps(report, indent=1))
                continue
            outs = r.pop("outputs")
            r["rows_equal_ar"] = sum(o == a for o, a in zip(outs, ar_ref))
            r["rows"] = len(outs)
            r["options"] = dataclasses.asdict(opts)
            report["runs"][key] = r
            log(f"{key}: {r['tokens_per_s']:.1f} tok/s, tau {r['tau']:.2f}, {r['calls']} calls / "
                f"{r['steps']} steps, {r['rows_equal_ar']}/{r['rows']} rows equal AR")
            if r.get("profile"):
                pr = r["profile"]
                log(f"{key} profile: wall {pr['wall_s'] * 1e3:.1f} ms, kernels {pr['kernel_s'] * 1e3:.1f} ms "
                    f"({pr['kernels']} kernels); top: " +
                    "; ".join(f"{k[:40]} x{c} {t * 1e3:.1f} ms" for k, c, t in pr["top"][:12]))
            (out_dir / f"serving_h200_{part}.json").write_text(json.dumps(report, indent=1))
    rows = []
    for batch in batches:
        ar = report["runs"].get(f"B{batch}/ar", {}).get("tokens_per_s")
        stock = report["runs"].get(f"B{batch}/stock", {}).get("tokens_per_s")
        for key, r in report["runs"].items():
            if key.startswith(f"B{batch}/") and "error" not in r:
                rows.append(f"| {batch} | {key.split('/')[1]} | {r['tokens_per_s']:.1f} | "
                            f"{r['tokens_per_s'] / ar if ar else float('nan'):.2f} | "
                            f"{r['tokens_per_s'] / stock if stock else float('nan'):.2f} | {r['tau']:.2f} | "
                            f"{r['rows_equal_ar']}/{r['rows']} |")
    print("| B | config | tok/s | x AR | x stock | tau | rows = AR |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
