"""The target's own LH12 size per weight group, for the cost model: bits per weight of the attn
(w_qkv, w_o), mlp (w_gate_up, w_down) and head (lm_head, or the tied embedding it streams)
matrices if each is stored as `choose_format` decides (tensors with too many escapes stay bf16 and
count 16 bits)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.models.params import ModelParams
from specjax.weights.lh12 import choose_format


def group_tensors(params: ModelParams) -> dict[str, list]:
    return {"attn": [t for layer in params.layers for t in (layer.w_qkv, layer.w_o)],
            "mlp": [t for layer in params.layers for t in (layer.w_gate_up, layer.w_down)],
            "head": [params.embed if params.lm_head is None else params.lm_head]}


def lh12_group_bits(params: ModelParams) -> tuple[float, float, float]:
    """(attn, mlp, head) bits per weight under LH12, weighted by each tensor's size."""
    out = []
    for tensors in group_tensors(params).values():
        bits = weights = 0.0
        for t in tensors:
            choice = choose_format(np.asarray(jnp.asarray(t, jnp.bfloat16)).view(np.uint16))
            bits += choice.bits_per_weight * choice.num_weights
            weights += choice.num_weights
        out.append(bits / max(weights, 1.0))
    return tuple(out)
