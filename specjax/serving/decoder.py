"""`engine.Decoder`'s interface over the serving engine, so what drives a Decoder (the token-
forcing harness, the search's evaluator, benchmarks) can run a batching configuration: a prompt
batch is submitted at once and served `num_slots` at a time with continuous batching."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from specjax.decoding.sequences import GenerationConfig
from specjax.engine import GenerationResult
from specjax.errors import ConfigError
from specjax.serving.engine import ServingEngine
from specjax.serving.state import ServingOptions


class ServingDecoder:
    def __init__(self, cfg, params, gen: GenerationConfig, drafter=None, num_slots: int = 4,
                 options: ServingOptions = ServingOptions(), page_size: int = 16,
                 prompt_width: int = 0, mesh=None, kernels: str = "xla"):
        """kernels: the target's GEMMs and norms: "xla", or our Pallas kernels ("pallas" on a GPU,
        "interpret" on a CPU; `engine.resolve_kernels` spells "auto"), as engine.Decoder runs them."""
        from specjax.engine import resolve_kernels
        from specjax.models.target import is_hybrid
        self.kernels = resolve_kernels(kernels, cfg)
        self.placed = False  # params already placed over the mesh (the engine then leaves them)
        if self.kernels != "xla" and is_hybrid(cfg):  # the decoder's attention and tree-GDN kernels
            params = dataclasses.replace(params, kernels=self.kernels)
        elif self.kernels != "xla":
            from specjax.models.kernel_params import prepare_kernel_params
            if mesh is not None:  # placed first, then each split matrix a per-device kernel weight,
                from specjax.sharding.tp import shard_params  # as engine.Decoder does
                params, self.placed = shard_params(params, mesh)[0], True
            params, _ = prepare_kernel_params(params, cfg, interpret=self.kernels == "interpret", mesh=mesh)
        self.cfg, self.params, self.gen, self.drafter = cfg, params, gen, drafter
        self.mesh = mesh  # tensor parallelism (passed to each ServingEngine)
        self.num_slots, self.options, self.page_size = num_slots, options, page_size
        self.prompt_width = prompt_width

    def _shape(self, prompts):
        width = max(self.prompt_width, max(len(p) for p in prompts))
        k = 0 if self.drafter is None else self.drafter.k
        over = self.options.check(k, self.num_slots).overshoot(k)
        slot_len = -(-(width + self.gen.max_new_tokens + over + 1) // self.page_size) * self.page_size
        return width, slot_len

    def pack(self, prompts):
        """(unused, unused, slot length): the forcing harness sizes its reference rows with it."""
        if not prompts:
            raise ConfigError("no prompts given")
        return None, None, self._shape(prompts)[1]

    def engine(self, prompts, seed: int = 0, forcing: bool = False) -> ServingEngine:
        width, slot_len = self._shape(prompts)
        return ServingEngine(self.cfg, self.params, self.drafter, num_slots=self.num_slots,
                             slot_len=slot_len, page_size=self.page_size, prompt_width=width,
                             queue_len=self.num_slots, max_waiting=max(len(prompts), 1),
                             sampling=self.gen.sampling, stop_tokens=self.gen.stop_tokens,
                             options=self.options, seed=seed, forcing=forcing, mesh=self.mesh, placed=self.placed)

    def generate(self, prompts: list[list[int]], seed: int = 0, forced=None) -> GenerationResult:
        engine = self.engine(prompts, seed, forcing=forced is not None)
        refs = [None] * len(prompts)
        if forced is not None:
            ref_tokens, ref_len = np.asarray(forced.ref_tokens), np.asarray(forced.ref_length)
            refs = [ref_tokens[b, len(p):ref_len[b]].tolist() for b, p in enumerate(prompts)]
        t = time.perf_counter()
        rids = [engine.submit(p, self.gen.max_new_tokens, reference=r) for p, r in zip(prompts, refs)]
        results = engine.run()
        seconds = time.perf_counter() - t
        res = [results[r] for r in rids]
        bad = [r for r in res if r.status != "finished"]
        if bad:
            raise RuntimeError(f"request {bad[0].rid} {bad[0].status}: {bad[0].error}")
        k = 0 if self.drafter is None else self.drafter.k
        hist = np.stack([r.accepted_hist for r in res])
        out_forced = None
        if forced is not None:
            out_forced = {key: np.stack([r.forced[key] for r in res])
                          for key in ("mismatch", "engine_token", "checked")}
        return GenerationResult(
            tokens=[r.tokens for r in res], margins=[[np.inf] * len(r.tokens) for r in res],
            prefill_s=0.0, decode_s=seconds, compile_s=0.0, steps=engine.steps,
            rounds=np.array([r.rounds for r in res]), accepted_hist=hist if k else None, forced=out_forced)
