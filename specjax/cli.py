"""`specjax` command line. User errors print one line and exit with code 2, without a traceback."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specjax.errors import ConfigError, SpecJaxError
from specjax.prompts import humaneval_prompts, read_prompts_file


def chatml(tokenizer, text: str) -> str:
    if "<|im_start|>" not in tokenizer.backend.get_vocab():
        raise ConfigError("--chat needs a ChatML vocabulary (<|im_start|>); this model has none")
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _stats_line(r) -> str:
    parts = [f"tokens={r.num_generated}", f"prefill={r.prefill_s * 1e3:.1f}ms",
             f"decode={r.decode_s * 1e3:.1f}ms", f"steps={r.steps}",
             f"ms/step={r.decode_s * 1e3 / max(r.steps, 1):.2f}", f"tok/s={r.tokens_per_s:.1f}",
             f"tau={r.tau:.2f}"]
    if r.acceptance_rates:
        parts.append("accept=[" + ",".join(f"{a:.2f}" for a in r.acceptance_rates) + "]")
    parts.append(f"compile={r.compile_s:.1f}s")
    return "[stats] " + " ".join(parts)


BLOCK_DEFAULT_K = 7  # the shipped block drafters: block 8 (and 16)


def cmd_generate(args) -> int:
    from specjax.decoding.sequences import GenerationConfig
    from specjax.drafters.factory import make_drafter
    from specjax.engine import Decoder
    from specjax.models.loading import load_model
    from specjax.sampling import SamplingConfig

    if args.k is None:
        args.k = BLOCK_DEFAULT_K if args.drafter == "block" else 4
    if args.k < 1:
        raise ConfigError(f"--k must be >= 1, got {args.k}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    texts = []
    if args.prompt is not None:
        texts.append(args.prompt)
    if args.prompts_file:
        texts += read_prompts_file(args.prompts_file)
    if args.humaneval:
        texts += humaneval_prompts(args.humaneval)
    if not texts:
        raise ConfigError("give a prompt: --prompt TEXT, --prompts-file FILE or --humaneval N")

    target = load_model(args.model, dtype=args.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"model {args.model!r} has no tokenizer (tokenizer.json or GGUF metadata)")
    tok = target.tokenizer
    prompts = [tok.encode(chatml(tok, text) if args.chat else text) for text in texts]
    drafter = None if args.drafter == "none" else make_drafter(args.drafter, target, args.k, prompts=prompts,
                                                               max_new_tokens=args.max_new_tokens)
    stops = tuple(tok.eos_ids) if not args.ignore_eos else ()
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, stop_tokens=stops)
    engine = dict(kernels=args.kernels, kernel_tiles=args.kernel_tiles,
                  weights_format={g: args.weights for g in ("attn", "mlp", "head")})
    if args.tp > 1:
        from specjax.sharding.tp import tp_mesh
        engine["mesh"] = tp_mesh(args.tp)
    tree = None
    if (args.tree is not None or args.tree_shape) and drafter is None:
        raise ConfigError("--tree / --tree-shape need a drafter")
    if args.tree is not None and args.tree_shape:
        raise ConfigError("give --tree N or --tree-shape FILE, not both")
    if args.tree is not None:
        from specjax.decoding.tree import default_builder
        from specjax.trees.builders import TreeSpec
        tree = TreeSpec.budget(args.tree_builder or default_builder(drafter), args.tree, args.k)
    elif args.tree_shape:
        from specjax.trees.shape import load_tree_shape
        tree = load_tree_shape(args.tree_shape)
    decoder = Decoder(target.cfg, target.params, gen, drafter, tree=tree, **engine)
    reference = Decoder(target.cfg, target.params, gen, **engine) if args.compare_ar and drafter else None
    if decoder.kernels != "xla":
        kept = [r for r in decoder.kernel_report if r.format != args.weights]
        print(f"[kernels] {decoder.kernels}: {args.weights} weights"
              + (f" ({len(kept)} kept bf16, e.g. {kept[0].name}: {kept[0].reason})" if kept else ""))

    for i, ids in enumerate(prompts):
        result = decoder.generate([ids], seed=args.seed + i)
        print(f"=== prompt {i} ({len(ids)} tokens)")
        print(tok.decode(result.tokens[0]))
        print(_stats_line(result))
        if reference is not None:
            reference.generate([ids], seed=args.seed + i)  # compile outside the timed run
            ar = reference.generate([ids], seed=args.seed + i)
            same = "identical" if ar.tokens == result.tokens else "DIFFERENT"
            print(f"[ar] tok/s={ar.tokens_per_s:.1f} speedup={result.tokens_per_s / ar.tokens_per_s:.2f}x "
                  f"tokens {same} to AR" + ("" if sampling.greedy else " (sampling: equal only in law)"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Lossless speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text, optionally with a drafter")
    g.add_argument("--model", default="smollm2-135m",
                   help="registry name (smollm2-135m), HF checkpoint directory, or .gguf file")
    g.add_argument("--drafter", default="ngram",
                   help="none | ngram | ngram:MAX_N | layerskip:K | block (the shipped trained drafter) | "
                        "block:DIR|FILE (trained by train-drafter) | block:random[:LAYERS] | "
                        "replay:PROFILE:LAYERS (acceptance replay) | PATH of a small model (default ngram)")
    g.add_argument("--k", type=int, help="draft tokens per round (default 4; with --drafter block, the "
                                         "shipped drafter's: 7)")
    g.add_argument("--tree", type=int, metavar="N",
                   help="verify a tree of N drafted nodes, at most k deep, instead of a chain (any drafter "
                        "but replay; greedy or sampled)")
    g.add_argument("--tree-shape", metavar="FILE.yaml",
                   help="verify this static tree (`parents: [-1, 0, 0, 1, ...]`, at most k deep) instead of a chain")
    g.add_argument("--tree-builder", choices=["static", "best_first", "topk"],
                   help="how --tree spends its nodes: static (TreeShape.for_budget: the top-1 chain plus "
                        "alternatives top down), best_first (the N likeliest paths, per row and step), topk "
                        "(the drafter's chain plus its likeliest alternatives). Default: best_first for block "
                        "drafters, topk for AR drafters")
    g.add_argument("--prompt")
    g.add_argument("--prompts-file", help=".jsonl (strings or {\"prompt\": ...}) or text, one per line")
    g.add_argument("--humaneval", type=int, default=0, metavar="N", help="use the first N HumanEval prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a ChatML user turn")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-turn token")
    g.add_argument("--kernels", choices=["auto", "xla", "pallas", "interpret"], default="auto",
                   help="matmuls: XLA (auto, for now) or the Pallas skinny GEMMs (pallas: GPU; interpret: CPU)")
    g.add_argument("--weights", choices=["bf16", "lh12"], default="bf16",
                   help="weight format the kernels read: bf16 or lossless 12-bit (needs --dtype bfloat16)")
    g.add_argument("--kernel-tiles", choices=["default", "tuned"], default="default",
                   help="kernel tile configs: from the shape, or from `specjax tune-kernels`")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: split the target's weights over N devices (jax.sharding; XLA matmuls)")
    g.add_argument("--compare-ar", action="store_true",
                   help="also run plain AR on each prompt: speedup and token equality")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("search", help="search mechanism spaces declared in a YAML spec")
    s.add_argument("spec", help="search spec, e.g. search_specs/cpu.yaml")
    s.add_argument("--output", help="output directory (default: the spec's `output`)")
    s.add_argument("--resume", action="store_true", help="continue a killed search from its state.json")
    s.add_argument("--agents", type=int, help="parallel proposing agents (default: the spec's budget)")
    s.add_argument("--proposer", choices=["offline", "gemini", "replay"], help="override the spec's proposer")
    s.add_argument("--memory", default="memory_store", help="memory store directory")
    s.add_argument("--evaluator", choices=["inprocess", "subprocess", "ray"],
                   help="override the spec's evaluator.kind (subprocess/ray: one worker per GPU, hard timeouts)")
    s.add_argument("--plain", action="store_true", help="plain progress lines instead of the live display")
    s.set_defaults(func=cmd_search)

    k = sub.add_parser("pack", help="pack a model's bf16 weights losslessly into 12 bits per weight (.w12)")
    k.add_argument("model", help="registry name (smollm2-135m), HF checkpoint directory, or .gguf file")
    k.add_argument("out", help="output file, ending in .w12 (load it anywhere a model is taken)")
    k.set_defaults(func=cmd_pack)

    d = sub.add_parser("train-drafter", help="train a block drafter for a target by self-distillation")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--out", required=True, help="checkpoint directory (resumes when it holds one)")
    d.add_argument("--block-size", type=int, default=8, help="1 pending token + block-size - 1 drafts")
    d.add_argument("--layers", type=int, default=1)
    d.add_argument("--taps", help="target layers to condition on, e.g. 1,14,28 (default: 3 spread)")
    d.add_argument("--conv", action="store_true", help="two-tap in-block convolution (DFlash2-style)")
    d.add_argument("--steps", type=int, default=1000)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--anchors", type=int, default=8)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--prompts", type=int, default=256, help="training prompts (half HumanEval, half ShareGPT)")
    d.add_argument("--held-out", type=int, default=8, help="held-out prompts per source, for τ")
    d.add_argument("--stop-after", type=int, help="end after this step of the --steps schedule "
                                                  "(checkpointed; reproduces a run that --max-minutes cut)")
    d.add_argument("--max-minutes", type=float, help="end training after this many minutes (checkpointed)")
    d.add_argument("--chat-prompts", help="chat prompts from a file (.jsonl or one per line) instead of "
                                          "ShareGPT's, e.g. your own traffic")
    d.add_argument("--compare", default="ngram,layerskip:8",
                   help="drafters whose held-out τ is measured beside the trained one, at the same k "
                        "(comma-separated drafter specs; empty for none)")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_train_drafter)
    t = sub.add_parser("tune-kernels", help="tune the skinny GEMM tiles for a model's shapes on this GPU")
    what = t.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="registry name (smollm2-135m), HF checkpoint directory, .gguf or .w12 "
                                      "file: its w_qkv, w_o, w_gate_up, w_down and lm_head shapes")
    what.add_argument("--shapes", help="[in, out] weight shapes instead of a model, e.g. 4096x4096,4096x14336")
    t.add_argument("--budget-s", type=float, default=300.0, help="seconds of tuning (default 300)")
    t.add_argument("--ceiling-gbps", type=float,
                   help="read bandwidth the gaps are measured to (default: this device's calibration, "
                        "else its nominal figure, else the H200's 4070)")
    t.add_argument("--memory", default="memory_store", help="memory store directory (cache: kernels/<device>.json)")
    t.add_argument("--phase", choices=["pair", "wide", "both"], default="both",
                   help="pair: the numerics and speed settings of T = 1 and 16 (one pair of bf16/12-bit "
                        "configs per shape); wide: speed settings for T > 16 under the cached pair's "
                        "numerics; both (default)")
    t.add_argument("--timer", choices=["kernel", "loop"], default="kernel",
                   help="kernel: the kernels' own durations from a profiler trace (default); loop: host "
                        "clock around a jit'd loop of calls, loop overhead included")
    t.add_argument("--fake-timer", action="store_true",
                   help="test only: a deterministic stand-in for GPU timings, so the command runs without a "
                        "GPU; its numbers mean nothing, and it caches under <device>-fake")
    t.set_defaults(func=cmd_tune_kernels)

    from specjax.memory.cli import add_memory_parser
    add_memory_parser(sub)
    from specjax.bench.cli import add_bench_parser
    add_bench_parser(sub)
    return parser


def cmd_train_drafter(args) -> int:
    import time

    import jax
    from rich.progress import Progress

    from specjax.atomic import write_json_atomic
    from specjax.decoding.sequences import GenerationConfig
    from specjax.drafters.block import init_block_drafter
    from specjax.drafters.block_train import Checkpoints, TrainConfig, distill, export_block_drafter, train
    import numpy as np

    from specjax.drafters.factory import make_drafter
    from specjax.drafters.replay import profile_from_hist, save_profile
    from specjax.engine import Decoder, pooled_tau
    from specjax.models.loading import load_model
    from specjax.prompts import sharegpt_prompts

    for name in ("block_size", "layers", "steps", "batch", "anchors", "prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    target = load_model(args.model, dtype=args.dtype)
    tok = target.tokenizer
    if tok is None:
        raise ConfigError(f"model {args.model!r} has no tokenizer")
    half, held = args.prompts // 2, args.held_out
    code = humaneval_prompts(min(164, held + half))
    if args.chat_prompts:
        chat = read_prompts_file(args.chat_prompts)
        if len(chat) < held + args.prompts - half:
            raise ConfigError(f"{args.chat_prompts}: {len(chat)} prompts, need {held + args.prompts - half} "
                              f"(--held-out {held} + half of --prompts {args.prompts})")
        chat = chat[:held + args.prompts - half]
    else:
        chat = sharegpt_prompts(held + args.prompts - half)
    held_out = {"humaneval": code[:held], "sharegpt": chat[:held]}
    train_texts = code[held:] + chat[held:]
    try:
        taps = None if args.taps is None else [int(t) for t in args.taps.split(",")]
    except ValueError:
        raise ConfigError(f"--taps must be comma-separated integers, got {args.taps!r}") from None
    drafter = init_block_drafter(target.params, target.cfg, jax.random.PRNGKey(args.seed), args.block_size,
                                 args.layers, taps, args.conv)
    print(f"[data] {len(train_texts)} prompts -> the target's own continuations "
          f"(<= {args.max_new_tokens} tokens, half greedy, half sampled)")
    corpus = distill(target.params, target.cfg, [tok.encode(t) for t in train_texts], args.max_new_tokens,
                     seed=args.seed, stop_tokens=tok.eos_ids)
    tcfg = TrainConfig(steps=args.steps, batch=args.batch, anchors=args.anchors, learning_rate=args.lr,
                       seed=args.seed)
    with Progress() as bar:
        task = bar.add_task("training", total=args.steps)
        deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
        trained, _ = train(drafter, target.params, target.cfg, corpus, tcfg, args.out,
                           meta={"model": args.model}, stop_after=args.stop_after, deadline=deadline,
                           progress=lambda step, loss: bar.update(task, completed=step,
                                                                  description=f"loss {loss:.3f}"))
    ckpt = Checkpoints(args.out)
    steps_done = ckpt.latest()
    ckpt.manager.close()
    print(f"[train] {steps_done} of {args.steps} steps")
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_tokens=tok.eos_ids)
    k = args.block_size - 1
    drafters = {"block": trained}
    for spec in filter(None, (args.compare or "").split(",")):
        drafters[spec] = make_drafter(spec, target, k)
    taus: dict = {}
    hists = []  # the block drafter's accepted-draft histograms: its recorded acceptance profile
    for dname, d in drafters.items():
        decoder = Decoder(target.cfg, target.params, gen, d)
        for name, texts in held_out.items():
            if texts:
                res = [decoder.generate([tok.encode(t)]) for t in texts]
                if dname == "block":
                    hists += [r.accepted_hist.sum(axis=0) for r in res]
                taus.setdefault(dname, {})[name] = pooled_tau(res)
                print(f"[held-out] {dname:>12} {name}: τ = {taus[dname][name]:.2f} (greedy, k = {k})")
    write_json_atomic(Path(args.out) / "held_out.json",
                      {"tau": taus["block"], "tau_by_drafter": taus, "k": k, "block_size": args.block_size,
                       "steps": args.steps, "steps_done": steps_done,
                       "model": args.model, "layers": args.layers,
                       "taps": list(trained.taps), "held_out_prompts": held})
    if hists:
        save_profile(Path(args.out) / "profile.json", profile_from_hist(np.sum(hists, axis=0)),
                     {"target": args.model, "drafter": f"block{args.block_size}", "layers": args.layers,
                      "prompts": "held-out HumanEval + ShareGPT", "held_out_per_source": held})
    size = export_block_drafter(trained, Path(args.out) / "drafter.safetensors", target.cfg)
    print(f"[export] {Path(args.out) / 'drafter.safetensors'}: {size / 1e6:.1f} MB (bf16 weights, "
          f"use with --drafter block:PATH --k {args.block_size - 1})")
    return 0


def cmd_tune_kernels(args) -> int:
    import jax

    from specjax.costmodel.hardware import NOMINAL, current_device_name, load_calibration
    from specjax.search.kernel_tuner import DEFAULT_CEILING, FakeTimer, KernelTuner, model_shapes, parse_shapes

    if args.budget_s <= 0:
        raise ConfigError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.ceiling_gbps is not None and args.ceiling_gbps <= 0:
        raise ConfigError(f"--ceiling-gbps must be > 0, got {args.ceiling_gbps}")
    platform = jax.devices()[0].platform
    if platform != "gpu" and not args.fake_timer:  # interpret mode runs kernels in Python: no speed to tune
        raise ConfigError(f"tune-kernels needs a GPU (found {platform})")
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        from specjax.models.loading import load_model
        shapes = model_shapes(load_model(args.model).cfg)
    name = current_device_name()
    known = load_calibration(args.memory, name) or NOMINAL.get(name)
    ceiling = args.ceiling_gbps * 1e9 if args.ceiling_gbps else known.bandwidth if known else DEFAULT_CEILING
    if args.fake_timer:
        time_fn, name = FakeTimer(ceiling), f"{name}-fake"
    else:
        from specjax.search.kernel_timer import KernelTimer
        time_fn = KernelTimer(method=args.timer)
    # both phases: two thirds of the budget to the pairs, the rest (and what they left) to wide steps
    pair_s = args.budget_s * (2 / 3 if args.phase == "both" else 1.0)
    print(f"tuning {len(shapes)} shapes on {name} for {args.budget_s:.0f} s ({args.phase}); "
          f"ceiling {ceiling / 1e9:.0f} GB/s")
    started = time.monotonic()
    if args.phase in ("pair", "both"):
        tuner = KernelTuner(time_fn, name, args.memory, ceiling=ceiling, budget_s=pair_s)
        results = tuner.run(shapes)
        tuned = sum(r.best is not None for r in results)
        print(f"{tuned} of {len(shapes)} shapes tuned; cache {tuner.path}")
    if args.phase in ("wide", "both"):
        left = args.budget_s - (time.monotonic() - started)
        tuner = KernelTuner(time_fn, name, args.memory, ceiling=ceiling, budget_s=max(left, 1.0))
        results = tuner.run_wide(shapes)
        print(f"wide steps (T = 64) tuned for {len(results)} of {len(shapes)} shapes; cache {tuner.path}")
    return 0


def cmd_pack(args) -> int:
    import os

    from specjax.weights.container import pack_model

    choices = pack_model(args.model, args.out)
    weights = sum(c.num_weights for c in choices.values())
    packed = sum(c.format == "lh12" for c in choices.values())
    size = os.path.getsize(args.out)
    print(f"{args.out}: {packed} of {len(choices)} tensors in LH12, {size / 1e6:.1f} MB, "
          f"{8 * size / weights:.2f} bits/weight including the header")
    return 0


def cmd_search(args) -> int:
    from specjax.search.run import run_search

    if args.agents is not None and args.agents < 1:
        raise ConfigError(f"--agents must be >= 1, got {args.agents}")
    from specjax.search.progress import LiveProgress
    with LiveProgress(force_plain=args.plain) as progress:
        run_search(args.spec, output=args.output, resume=args.resume, agents=args.agents,
                   proposer=args.proposer, memory_dir=args.memory, progress=progress, evaluator=args.evaluator)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecJaxError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    except NotImplementedError as e:
        print(f"specjax: not implemented: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
