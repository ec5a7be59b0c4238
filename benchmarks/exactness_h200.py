"""Where does a verify step stop matching AR steps bit for bit? (device diagnostic)

    python benchmarks/exactness_h200.py [--model FILE.gguf] [--kernels pallas|xla] [--width 8] [--batch 2]
                                        [--prompt-len 64] [--tree 16]

Runs one verify step over W tokens and W AR steps over the same tokens from the same cache, and
compares, bitwise, the residual stream after every layer and the logits, row by row; then the
step's ops in isolation at width 1 and W (RMSNorm, the GEMMs, attention), and RMSNorm alone over
many random draws at batch B (the model's norm and XLA's: on the CPU XLA's changed with the row
count, docs/notes/perf.md 2026-12-06). Speculative decoding is token-exact only if every one of
them is width-invariant. Without --model: a random 4-layer
SmolLM2-shaped model (also runs on a CPU). Writes $OUT/exactness_h200.json, prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.width_check import norm_vs_rows, ops_vs_width, step_vs_ar, tree_vs_ar  # noqa: E402


def model(args):
    if args.model:
        from specjax.models.loading import load_model
        m = load_model(args.model, dtype="bfloat16")
        return m.cfg, m.params
    from specjax.models.params import init_random_params
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=4, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=2048, dtype="bfloat16")
    return cfg, init_random_params(cfg, jax.random.PRNGKey(0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--kernels", default="xla", choices=["xla", "pallas", "interpret"])
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2, help="rows per call of the step comparison")
    ap.add_argument("--prompt-len", type=int, default=64,
                    help="context before the verified tokens (> 256 crosses the attention kernel's splits)")
    ap.add_argument("--tree", type=int, default=0,
                    help="also a tree verify step over a random tree of this many nodes vs AR per node")
    args = ap.parse_args()
    cfg, params = model(args)
    if args.kernels != "xla":
        from specjax.models.kernel_params import prepare_kernel_params
        params, _ = prepare_kernel_params(params, cfg, interpret=args.kernels == "interpret")
    res = {"meta": {"model": args.model or "random SmolLM2-shaped, 4 layers", "kernels": args.kernels,
                    "width": args.width, "batch": args.batch, "prompt_len": args.prompt_len,
                    "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind},
           "step": step_vs_ar(params, cfg, args.width, prompt_len=args.prompt_len, batch=args.batch), "ops": ops_vs_width(params, cfg, args.width),
           "norm": norm_vs_rows(params, cfg, args.width, args.batch)}
    if args.tree:
        res["tree"] = tree_vs_ar(params, cfg, args.tree, prompt_len=args.prompt_len, batch=args.batch)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "exactness_h200.json").write_text(json.dumps(res, indent=1))
    print(f"\nverify step over {args.width} tokens vs {args.width} AR steps ({args.kernels}):")
    print("  first differing layer per row:", res["step"]["first_layer_differing"])
    print("  logits equal per row:        ", res["step"]["logits_equal"])
    print("  ops width-invariant:         ", res["ops"])
    print(f"  RMSNorm draws differing, 1 vs {args.width} rows x {args.batch}:", res["norm"]["differing_draws"])
    if args.tree:
        for name, eq in res["tree"]["logits_equal"].items():
            print(f"  tree of {args.tree} nodes, {name}: logits equal to AR's at {sum(eq)} of {len(eq)} nodes")


if __name__ == "__main__":
    main()
