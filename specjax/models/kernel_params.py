"""Lay a bf16 model's matrices out for the Pallas skinny GEMMs, per tensor group and format.

Groups: attn (w_qkv, w_o), mlp (w_gate_up, w_down), head (lm_head, or the tied embedding's
transpose: the head must stream [D, V] rows, and the gather of `embed` keeps the [V, D] copy).
Format per group: "bf16" or "lh12"; an LH12 tensor whose escape segments exceed the format's
limit stays bf16 (as `choose_format` decides for a file), and the report says so.

Both formats of one shape use one config's numerics (block_k, split_k), from the shape alone or
from the per-device tuning cache, so a 12-bit model's tokens equal the bf16 model's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.skinny_gemm import GemmConfig, default_config, prepare_bf16
from pallas_kernels.skinny_gemm_lh12 import pack_for_kernel, prepare_lh12
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.params import ModelParams
from specjax.weights.lh12 import LAYOUT

GROUPS = ("attn", "mlp", "head")
FORMATS = ("bf16", "lh12")
GROUP_OF = {"w_qkv": "attn", "w_o": "attn", "w_gate_up": "mlp", "w_down": "mlp"}


@dataclasses.dataclass
class TensorReport:
    name: str
    shape: tuple[int, int]
    format: str  # what the kernel reads
    bits_per_weight: float
    config: GemmConfig
    reason: str = ""


Configs = dict[tuple[tuple[int, int], str], GemmConfig]  # (shape, format) -> config


def config_for(shape: tuple[int, int], fmt: str, tiles: str, configs: Configs | None = None) -> GemmConfig:
    """One shape's config for one format. Speed settings may differ per format; numerics must
    not (the tuner's cache and `default_config` guarantee it; explicit `configs` are checked)."""
    if configs and (shape, fmt) in configs:
        cfg = configs[(shape, fmt)]
        other = configs.get((shape, "bf16" if fmt == "lh12" else "lh12"))
        if other is not None and other.numerics != cfg.numerics:
            raise ConfigError(f"kernel configs of {shape}: bf16 and lh12 must share (block_k, split_k), "
                              f"got {cfg.numerics} and {other.numerics}")
        return cfg
    if tiles == "default":
        return default_config(shape, fmt)
    if tiles == "tuned":
        from specjax.search.kernel_tuner import tuned_config
        return tuned_config(shape, fmt)
    raise ConfigError(f"kernel tiles must be 'default' or 'tuned', got {tiles!r}")


def _prepare(name: str, w: jax.Array, fmt: str, tiles: str, interpret: bool, configs: Configs | None):
    shape = tuple(int(d) for d in w.shape)
    cfg = config_for(shape, fmt, tiles, configs)
    w = jnp.asarray(w, jnp.bfloat16)
    if fmt == "lh12":
        packed, permuted = pack_for_kernel(jax.lax.bitcast_convert_type(w, jnp.uint16), cfg)
        segs = shape[0] * -(-shape[1] // LAYOUT.segment)
        frac = packed.n_escape / max(segs, 1)
        if frac <= LAYOUT.max_escape_fraction:
            return prepare_lh12(packed, cfg, interpret, permuted), TensorReport(
                name, shape, "lh12", packed.bits_per_weight, cfg, f"{frac:.2%} escape segments")
        reason = f"{frac:.1%} escape segments (limit {LAYOUT.max_escape_fraction:.0%}): kept bf16"
        cfg = config_for(shape, "bf16", tiles, configs)
    else:
        reason = ""
    return prepare_bf16(w, cfg, interpret), TensorReport(name, shape, "bf16", 16.0, cfg, reason)


def prepare_kernel_params(params: ModelParams, cfg: ModelConfig, formats: dict[str, str] | None = None,
                          tiles: str = "default", interpret: bool = False,
                          configs: Configs | None = None, mesh=None) -> tuple[ModelParams, list[TensorReport]]:
    """params with every matrix as a kernel weight, and what each became. `interpret` runs the
    kernels in Pallas interpret mode (CPU tests); otherwise they need a GPU. `configs` pins
    (shape, format) -> config (benchmarks use their sweep's winners). `mesh`: a "tp" mesh the
    params are already placed on (specjax.sharding.tp.shard_params): bf16 matrices the rules split
    become `TPGemmWeight`s (one kernel per device, specjax/sharding/tp_kernels.py)."""
    if cfg.dtype != "bfloat16":
        raise ConfigError(f"the Pallas kernels read bf16 weights; this model is {cfg.dtype} "
                          "(load it with dtype bfloat16)")
    formats = {g: "bf16" for g in GROUPS} | dict(formats or {})
    for group, fmt in formats.items():
        if group not in GROUPS or fmt not in FORMATS:
            raise ConfigError(f"weight format {group}={fmt!r}: groups are {GROUPS}, formats {FORMATS}")

    def prepare(label, field, w, fmt):
        if mesh is not None:
            from specjax.sharding.tp_kernels import tp_kernel_weight
            over = f"-parallel over {mesh.shape['tp']} devices"
            reason = ""
            if fmt == "lh12":
                from specjax.sharding.tp_lh12 import tp_lh12_weight
                tw = tp_lh12_weight(field, w, mesh, lambda shape: config_for(shape, "lh12", tiles, configs),
                                    interpret)
                if isinstance(tw, str):  # too many escapes: bf16, as on one device
                    reason = f"; {tw}"
                elif tw is not None:
                    bits = tw.nbytes * 8 / (tw.shape[0] * tw.shape[1])
                    return tw, TensorReport(label, tw.shape, "lh12", bits, tw.config, f"{tw.mode}{over}")
            tw = tp_kernel_weight(field, w, mesh, lambda shape: config_for(shape, "bf16", tiles, configs),
                                  interpret)
            if tw is not None:
                return tw, TensorReport(label, tw.shape, "bf16", 16.0, tw.config, f"{tw.mode}{over}{reason}")
        return _prepare(label, w, fmt, tiles, interpret, configs)

    report, layers = [], []
    for i, layer in enumerate(params.layers):
        new = {}
        for field, group in GROUP_OF.items():
            new[field], r = prepare(f"layers.{i}.{field}", field, getattr(layer, field), formats[group])
            report.append(r)
        layers.append(dataclasses.replace(layer, **new))
    head = params.embed.T if params.lm_head is None else params.lm_head
    lm_head, r = prepare("lm_head", "lm_head", head, formats["head"])
    report.append(r)
    mode = "interpret" if interpret else "pallas"
    return dataclasses.replace(params, layers=layers, lm_head=lm_head, attention=mode, norm=mode,
                               mesh=mesh), report


def kernels_available() -> bool:
    """The skinny GEMMs compile for NVIDIA GPUs (Pallas' Triton backend)."""
    return jax.devices()[0].platform == "gpu"
