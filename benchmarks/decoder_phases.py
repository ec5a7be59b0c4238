"""Where does a batched verify step of the `Decoder` spend its time? (device script)

    python -u benchmarks/decoder_phases.py [--gguf PATH] [--dtype float32] [--batches 1,32] [--k 4]
    python -u benchmarks/decoder_phases.py --smoke      # CPU, tiny model, seconds

On 2026-12-05 (H100, SmolLM2 float32, `docs/results/bench_h100_fp32/`) a 32 x 5-token n-gram verify
step of the `Decoder` cost ~2.4x an AR step (6.5 vs 2.7 ms), far more than its weight reads
explain. This times each phase of a chain step apart, as R dependent iterations inside one jit
(a loop-carried value feeds every iteration, so nothing is hoisted), at each batch size:

    ar_step     one AR step (forward T = 1, logits, choice, commit)
    chain_step  one chain step with the n-gram drafter (all of the below)
    forward_1   the target forward at T = 1 (no logits)
    forward_k1  the target forward at T = k + 1 (the verify pass)
    logits_k1   the LM head over k + 1 positions
    accept      greedy acceptance and the top-2 margins over [B, k + 1, V]
    propose     the n-gram drafter's proposal
    commit      the round's bookkeeping and token commit

Without --gguf the target is a random model of SmolLM2-135M's shape. Prints a table last and
writes $OUT/decoder_phases.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.decoding.ar import ar_step  # noqa: E402
from specjax.decoding.chain import ChainStats, chain_step, finish_round  # noqa: E402
from specjax.decoding.sequences import GenerationConfig, prefill  # noqa: E402
from specjax.drafters.ngram import NgramDrafter  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.target import chain_verify, target_forward, target_logits  # noqa: E402
from specjax.sampling import top2_margin  # noqa: E402
from specjax.verification.chain import greedy_accept  # noqa: E402
from specjax.rounding import exact_jit  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)


def load_target(args):
    if args.gguf:
        from specjax.models.loading import load_model
        m = load_model(args.gguf, dtype=args.dtype)
        return m.cfg, m.params
    from specjax.models.params import init_random_params
    cfg = ModelConfig(**(TINY if args.smoke else SMOLLM2), dtype=args.dtype)
    return cfg, init_random_params(cfg, jax.random.PRNGKey(0))


def phases(params, cfg, k: int, reps: int):
    """name -> jitted fn(state) running `reps` dependent iterations of that phase."""
    gen = GenerationConfig(max_new_tokens=1 << 30)
    drafter = NgramDrafter(k=k, vocab_size=cfg.vocab_size)
    loop = lambda body, init: jax.lax.fori_loop(0, reps, lambda i, c: body(c), init)  # noqa: E731

    def everything(cache, seqs):  # a result that depends on every layer and every token: nothing is dropped
        return sum(x.astype(jnp.float32).sum() for x in cache.k + cache.v) + seqs.tokens.sum()

    def ar(s):
        cache, seqs = loop(lambda c: ar_step(params, cfg, gen, c[0], c[1], s["key"]), (s["cache"], s["seqs"]))
        return everything(cache, seqs)

    def chain(s):
        stats = ChainStats.zeros(s["seqs"].length.shape[0], k)
        def body(c):
            cache, _, seqs, stats, _ = chain_step(params, cfg, drafter, gen, c[0], (), c[1], c[2], s["key"])
            return cache, seqs, stats
        cache, seqs, _ = loop(body, (s["cache"], s["seqs"], stats))
        return everything(cache, seqs)

    def forward(width):
        def run(s):
            tokens = s["tokens"][:, :width]
            pos = s["seqs"].length - 1
            positions = pos[:, None] + jnp.arange(width)[None, :]

            def body(c):
                cache, acc = c
                if width == 1:
                    hidden, _, cache = target_forward(params, cfg, tokens, positions, cache, pos)
                else:
                    hidden, _, cache, _ = chain_verify(params, cfg, tokens, positions, cache, pos, ())
                return cache, acc + hidden.astype(jnp.float32).sum()
            cache, acc = loop(body, (s["cache"], jnp.float32(0)))
            return everything(cache, s["seqs"]) + acc
        return run

    def logits(s):
        def body(h):
            out = target_logits(params, cfg, h)
            return h + (out[..., :1] * 0).astype(h.dtype)
        return loop(body, s["hidden"]).sum()

    def accept(s):
        def body(x):
            n, out = greedy_accept(s["tokens"][:, 1:], x)
            return x + (top2_margin(x)[..., None] * 0 + n[:, None, None] * 0).astype(x.dtype)
        return loop(body, s["logits"]).sum()

    def propose(s):
        def body(seqs):
            draft = drafter.propose((), seqs, None, gen.sampling)[0]
            return dataclasses.replace(seqs, tokens=seqs.tokens.at[:, 0].set(draft[:, 0]))
        return loop(body, s["seqs"]).tokens.sum()

    def commit_round(s):
        B = s["seqs"].length.shape[0]

        def body(c):
            seqs, stats = c
            seqs, stats, _ = finish_round(gen, seqs, stats, None, s["tokens"], jnp.zeros(B, jnp.int32),
                                          jnp.zeros(s["tokens"].shape, jnp.float32))
            return seqs, stats
        seqs, stats = loop(body, (s["seqs"], ChainStats.zeros(B, k)))
        return seqs.tokens.sum() + seqs.length.sum() + stats.rounds.sum()

    fns = {"ar_step": ar, "chain_step": chain, "forward_1": forward(1), "forward_k1": forward(k + 1),
           "logits_k1": logits, "accept": accept, "propose": propose, "commit": commit_round}
    return {name: exact_jit(fn) for name, fn in fns.items()}


def state_for(params, cfg, batch: int, prompt_len: int, k: int, reps: int):
    key = jax.random.PRNGKey(batch)
    num_slots = prompt_len + (k + 1) * (reps + 2) + 64
    prompt = jax.random.randint(key, (batch, prompt_len), 0, cfg.vocab_size, jnp.int32)
    gen = GenerationConfig(max_new_tokens=1 << 30)
    cache, seqs, _, _ = exact_jit(prefill, static_argnames=("cfg", "gen", "num_slots"))(
        params, cfg, gen, prompt, jnp.full(batch, prompt_len, jnp.int32), num_slots, key)
    tokens = prompt[:, :k + 1]
    hidden = jnp.ones((batch, k + 1, cfg.hidden_size), jnp.dtype(cfg.dtype))
    logits = jax.random.normal(key, (batch, k + 1, cfg.vocab_size), jnp.float32).astype(cfg.dtype)
    return dict(cache=cache, seqs=seqs, key=key, tokens=tokens, hidden=hidden, logits=logits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--timings", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.timings, args.prompt_len = 2, 1, 32
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")  # as the float32 bench runs
    cfg, params = load_target(args)
    rows = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        state = state_for(params, cfg, batch, args.prompt_len, args.k, args.reps)
        for name, fn in phases(params, cfg, args.k, args.reps).items():
            t = time.perf_counter()
            jax.block_until_ready(fn(state))
            compile_s = time.perf_counter() - t
            times = []
            for _ in range(args.timings):
                t = time.perf_counter()
                jax.block_until_ready(fn(state))
                times.append((time.perf_counter() - t) / args.reps * 1e3)
            rows[f"{name} B={batch}"] = dict(phase=name, batch=batch, ms=statistics.median(times),
                                             spread=[min(times), max(times)], compile_s=compile_s)
            print(f"{name:>10} B={batch:<3} {statistics.median(times):8.3f} ms  (compile {compile_s:.1f} s)",
                  flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, dtype=args.dtype, k=args.k,
                prompt_len=args.prompt_len, reps=args.reps, model=args.gguf or ("tiny" if args.smoke else
                                                                                "random SmolLM2 shape"),
                commit=os.environ.get("SPECJAX_COMMIT", "unknown"))
    out = Path(os.environ.get("OUT", "."))
    (out / "decoder_phases.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    batches = sorted({r["batch"] for r in rows.values()})
    print("\n| phase | " + " | ".join(f"B={b} ms" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in dict.fromkeys(r["phase"] for r in rows.values()):
        print(f"| {name} | " + " | ".join(f"{rows[f'{name} B={b}']['ms']:.3f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
