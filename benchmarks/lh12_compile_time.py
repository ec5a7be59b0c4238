"""How long a 12-bit decoder takes to build and compile against bf16 (random weights of SmolLM2-135M's
shape, our Pallas kernels): the first `generate` call compiles every kernel of the decode loop.

    python benchmarks/lh12_compile_time.py [--tokens 8]

On 2026-12-07 (H200, before the LH12 kernel took its window base as data) the bench's first 12-bit
unit spent 427 s there against 13 s for bf16: one Triton kernel per tensor. Writes
$OUT/lh12_compile_time.json, prints a line per format.
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
from specjax.decoding.sequences import GenerationConfig  # noqa: E402
from specjax.engine import Decoder  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.params import init_random_params  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    cfg = ModelConfig(**SMOLLM2, dtype="bfloat16")
    params = init_random_params(cfg, jax.random.PRNGKey(0))
    out = {"device": jax.devices()[0].device_kind, "rows": []}
    for fmt in ("bf16", "lh12"):
        t0 = time.time()
        wf = None if fmt == "bf16" else {g: "lh12" for g in ("attn", "mlp", "head")}
        dec = Decoder(cfg, params, GenerationConfig(max_new_tokens=a.tokens), None, weights_format=wf,
                      kernels="pallas")
        built = time.time() - t0
        dec.generate([[1, 2, 3, 4]])
        first = time.time() - t0 - built
        t1 = time.time()
        dec.generate([[1, 2, 3, 4]])
        row = {"format": fmt, "build_s": built, "first_call_s": first, "second_call_s": time.time() - t1}
        out["rows"].append(row)
        print(row, flush=True)
    Path(os.environ.get("OUT", "/tmp")).mkdir(parents=True, exist_ok=True)
    (Path(os.environ.get("OUT", "/tmp")) / "lh12_compile_time.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
