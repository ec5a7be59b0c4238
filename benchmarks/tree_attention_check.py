"""Device check: does each tree node's attention (pallas_kernels/tree_attention.py) equal, bit for
bit, the AR step's (decode_attention at T = 1 with the node's path at contiguous slots)? And the
plain kernel under the dense tree mask? Random trees, SmolLM2's head shape. Writes
$OUT/tree_attention_check.json; prints counts last.

    python benchmarks/tree_attention_check.py [--trees 8] [--nodes 16] [--start 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pallas_kernels.decode_attention import decode_attention  # noqa: E402
from pallas_kernels.tree_attention import path_slots, tree_attention  # noqa: E402
from specjax.models.transformer import causal_slot_mask  # noqa: E402
from specjax.trees.tree import Tree  # noqa: E402
from specjax.trees.verify import tree_mask  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--start", type=int, default=300)
    args = ap.parse_args()
    interp = jax.devices()[0].platform != "gpu"
    n, s, hkv, g, hd = args.nodes, 512, 3, 3, 64
    out = {"device": jax.devices()[0].device_kind, "cases": []}
    for seed in range(args.trees):
        rng = np.random.default_rng(seed)
        k = jnp.asarray(rng.normal(0, 1, (1, s, hkv, hd)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(0, 1, (1, s, hkv, hd)), jnp.bfloat16)
        q = jnp.asarray(rng.normal(0, 1, (1, n, hkv * g, hd)), jnp.bfloat16)
        parents = np.array([[-1] + [int(rng.integers(0, i)) for i in range(1, n)]], np.int32)
        tree = Tree(tokens=jnp.zeros((1, n), jnp.int32), parents=jnp.asarray(parents), max_depth=n - 1)
        anc = tree.ancestors()
        depths = tree.depths(anc)
        start = jnp.array([args.start], jnp.int32)
        y = np.asarray(tree_attention(q, k, v, start, anc, depths, n - 1, interpret=interp), np.float32)
        dense = np.asarray(decode_attention(q, k, v, tree_mask(tree, start, s, anc), start + n, interpret=interp),
                           np.float32)
        paths = np.asarray(path_slots(anc, depths, start, n - 1))
        case = {"seed": seed, "depths": np.asarray(depths)[0].tolist(), "tree_eq_ar": [], "dense_eq_ar": [],
                "tree_max_abs": []}
        for i in range(n):
            d = int(depths[0, i])
            ks, vs = np.array(np.asarray(k, np.float32)), np.array(np.asarray(v, np.float32))
            ks[0, args.start:args.start + d + 1] = np.asarray(k, np.float32)[0][paths[0, i, :d + 1]]
            vs[0, args.start:args.start + d + 1] = np.asarray(v, np.float32)[0][paths[0, i, :d + 1]]
            pos = start + d
            ar = np.asarray(decode_attention(q[:, i:i + 1], jnp.asarray(ks, jnp.bfloat16), jnp.asarray(vs, jnp.bfloat16),
                                             causal_slot_mask(pos, 1, s), pos + 1, interpret=interp), np.float32)[0, 0]
            case["tree_eq_ar"].append(bool(np.array_equal(ar, y[0, i])))
            case["dense_eq_ar"].append(bool(np.array_equal(ar, dense[0, i])))
            case["tree_max_abs"].append(float(np.abs(ar - y[0, i]).max()))
        out["cases"].append(case)
    dst = Path(os.environ.get("OUT", "."))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tree_attention_check.json").write_text(json.dumps(out, indent=1))
    t = sum(sum(c["tree_eq_ar"]) for c in out["cases"])
    dn = sum(sum(c["dense_eq_ar"]) for c in out["cases"])
    total = sum(len(c["tree_eq_ar"]) for c in out["cases"])
    for c in out["cases"]:
        bad = [(i, c["depths"][i], c["tree_max_abs"][i]) for i, e in enumerate(c["tree_eq_ar"]) if not e]
        print(f"seed {c['seed']}: tree kernel differs at (node, depth, max abs) {bad}; dense differs at "
              f"{[i for i, e in enumerate(c['dense_eq_ar']) if not e]}")
    print(f"{out['device']}: tree kernel equal to AR at {t}/{total} nodes, dense mask at {dn}/{total}")


if __name__ == "__main__":
    main()
