"""Host-side driver: pads prompts into buckets, compiles each shape once (ahead of time, so timings
exclude compilation), runs prefill and the on-device decode loop, and unpacks results.

The jitted pieces (`ar_prefill`/`ar_decode`, `chain_prefill`/`chain_decode`) are what a JAX serving
stack embeds; this class is the convenience layer for the CLI, benchmarks and tests. It runs the
prefill in two parts, `sequences.prompt_pass` (one program shared by every decoder) and then
`ar_start` or `chain_start`, so AR and speculative runs read the same prompt K/V.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding.ar import ar_decode, ar_start
from specjax.decoding.chain import Forced, chain_decode, chain_start
from specjax.decoding.sequences import GenerationConfig, num_slots_for, prompt_bucket, prompt_pass
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.params import ModelParams
from specjax.models.target import is_hybrid


def pooled_tau(results) -> float:
    """τ over several results: all their verify rounds pooled (a per-result mean would count a
    prompt that ends before its first round, e.g. on an immediate end-of-turn, as τ = 0).
    1.0 without rounds (AR, or nothing drafted)."""
    hists = [r.accepted_hist.sum(axis=0) for r in results if r.accepted_hist is not None]
    if not hists:
        return 1.0
    hist = np.sum(hists, axis=0)
    if hist.sum() == 0:
        return 1.0
    return float((hist * np.arange(1, len(hist) + 1)).sum() / hist.sum())


_SHARED_PROGRAMS: dict = {}  # compiled programs every Decoder of this process reuses (the prompt pass)

@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per row, cut after a stop token / at max_new_tokens
    margins: list[list[float]]  # target top-1 minus top-2 logit behind each generated token
    prefill_s: float
    decode_s: float
    compile_s: float
    steps: int  # decode-loop iterations (the slowest row's)
    rounds: np.ndarray | None = None  # [B] verify rounds per row (speculative only)
    accepted_hist: np.ndarray | None = None  # [B, k + 1]
    forced: dict | None = None  # raw forcing findings (see forcing.py)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / max(self.prefill_s + self.decode_s, 1e-12)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verify step, bonus included (AR = 1.00)."""
        return pooled_tau([self])

    @property
    def acceptance_rates(self) -> list[float]:
        """P(draft i accepted) for i = 1..k, over all rounds."""
        if self.accepted_hist is None:
            return []
        hist = self.accepted_hist.sum(axis=0)
        at_least = np.cumsum(hist[::-1])[::-1]  # rounds with >= i accepted
        return [float(at_least[i] / max(hist.sum(), 1)) for i in range(1, len(hist))]


BF16_ON_XLA = (
    "speculative decoding of a bf16 target on XLA's kernels is not promised token-identical to AR: "
    "XLA picks GEMM and reduction orders per shape, so a verify step can round unlike an AR step "
    "(docs/design/kernels.md). For bit-exact bf16 use a dense target with kernels='pallas' on a GPU "
    "(AR and speculative alike), or float32.")


def resolve_kernels(kernels: str, cfg: ModelConfig) -> str:
    """"auto" -> "xla" (until the kernels beat XLA on the device); other values are checked."""
    if kernels not in ("auto", "xla", "pallas", "interpret"):
        raise ConfigError(f"kernels must be auto, xla, pallas or interpret, got {kernels!r}")
    if kernels == "auto":  # measured at T = 1: our bf16 step 4.756 ms vs XLA 4.383 (8B shape, H200)
        return "xla"
    if kernels == "pallas" and jax.devices()[0].platform != "gpu":
        raise ConfigError(f"kernels=pallas needs a GPU (found {jax.devices()[0].platform}); "
                          "use interpret to run the kernels on a CPU, slowly")
    return kernels


class Decoder:
    """Greedy or sampled generation with an optional drafter (None: plain AR)."""

    def __init__(self, cfg: ModelConfig, params: ModelParams, gen: GenerationConfig, drafter=None,
                 min_prompt_bucket: int = 0, weights_format: dict[str, str] | None = None,
                 kernel_tiles: str = "default", kernels: str = "auto", tree=None, mesh=None,
                 shard_drafter: bool = False):
        """kernels: "auto" (XLA for now: on the H200 the Pallas kernels measured slower than XLA,
        docs/results/kernels_h200.md), "xla", "pallas" (the skinny GEMMs on a GPU: bit-identical
        AR and verify steps, 12-bit weights), or "interpret" (the kernels in Pallas interpret mode).
        weights_format: per group (attn, mlp, head) "bf16" or "lh12", read by the kernels; on XLA
        the weights are the same bf16 values either way. kernel_tiles: "default" or "tuned".
        tree: verify trees of drafts instead of chains: a `TreeSpec` (builder, node budget, depth;
        specjax/trees/builders.py) or a `TreeShape` (the static builder), any drafter with
        per-position distributions (block_logits or propose_logits).
        mesh: a 1-D "tp" mesh (specjax.sharding.tp.tp_mesh): the target's weights are split over
        it (tensor parallelism; XLA partitions the same step functions, and with kernels the
        bf16 GEMMs run one per device in shard_map), the drafter's replicated, or split by the
        same rules with shard_drafter (docs/design/tensor_parallel.md)."""
        self.kernels = resolve_kernels(kernels, cfg)
        self.shard_report = None
        if mesh is not None:
            from specjax.sharding.tp import replicate, shard_params
            params, self.shard_report = shard_params(params, mesh)
            if drafter is not None:
                drafter = shard_params(drafter, mesh)[0] if shard_drafter else replicate(drafter, mesh)
        self.kernel_report = []
        if self.kernels != "xla" and is_hybrid(cfg):  # attention and tree-GDN kernels; XLA GEMMs
            if weights_format:
                raise ConfigError("weights_format (12-bit weights) is for dense targets only")
            # under a mesh the attention and tree-GDN kernels run split by heads (sharding/tp_hybrid.py)
            params = dataclasses.replace(params, kernels=self.kernels, mesh=mesh)
        elif self.kernels != "xla":
            from specjax.models.kernel_params import prepare_kernel_params
            params, self.kernel_report = prepare_kernel_params(
                params, cfg, weights_format, kernel_tiles, interpret=self.kernels == "interpret",
                mesh=mesh)
        if drafter is not None and cfg.dtype == "bfloat16" and (self.kernels == "xla" or is_hybrid(cfg)):
            warnings.warn(BF16_ON_XLA, stacklevel=2)  # hybrid targets run XLA's GEMMs on every path
        self.cfg, self.params, self.gen, self.drafter = cfg, params, gen, drafter
        # drafted tokens one step writes past the committed length: cache and buffer room
        self.overshoot = 0 if drafter is None else drafter.k
        self.tree = None
        if tree is not None:
            if drafter is None:
                raise ConfigError("tree verification needs a drafter")
            from specjax.decoding.tree import check_tree_drafter
            from specjax.trees.builders import as_tree_spec
            self.tree = as_tree_spec(tree)
            check_tree_drafter(drafter, self.tree, gen)
            self.overshoot = max(self.overshoot, self.tree.num_nodes)  # a tree step writes every node
        # Pad every prompt batch to at least this length: one compiled shape for a whole prompt set
        # (the search's evaluator), at the price of a longer prefill and a few more cache slots.
        self.min_prompt_bucket = min_prompt_bucket
        self._compiled: dict = {}

    # ------------------------------------------------------------------ input checks

    def pack(self, prompts: list[list[int]]):
        """Check and right-pad prompts -> (prompt [B, P], prompt_len [B], num_slots)."""
        if not prompts:
            raise ConfigError("no prompts given")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ConfigError(f"prompt {i} is empty")
            if len(p) + self.gen.max_new_tokens > self.cfg.max_position_embeddings:
                raise ConfigError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={self.gen.max_new_tokens} "
                    f"that exceeds the model context of {self.cfg.max_position_embeddings} tokens")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ConfigError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        P = max(prompt_bucket(max(len(p) for p in prompts)), self.min_prompt_bucket)
        arr = np.zeros((len(prompts), P), np.int32)
        for i, p in enumerate(prompts):
            arr[i, :len(p)] = p
        lens = np.array([len(p) for p in prompts], np.int32)
        return jnp.asarray(arr), jnp.asarray(lens), num_slots_for(P, self.gen.max_new_tokens, self.overshoot)

    def _run(self, name, fn, static: dict, **args):
        """Compile `fn` for these argument shapes once (timed apart), then run it to completion.
        Returns (outputs, compile seconds, run seconds)."""
        key = (name, tuple(sorted(static.items())), jax.tree.structure(args)) + tuple(
            (x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(args))
        # the prompt pass is compiled once per process, not per decoder: AR and speculative
        # decoders then run the very same executable over the prompt (sequences.prompt_pass)
        compiled = _SHARED_PROGRAMS if name == "prompt_pass" else self._compiled
        compile_s = 0.0
        if key not in compiled:
            t = time.perf_counter()
            compiled[key] = fn.lower(**args, **static).compile()
            compile_s = time.perf_counter() - t
        t = time.perf_counter()
        out = jax.block_until_ready(compiled[key](**args))
        return out, compile_s, time.perf_counter() - t

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], seed: int = 0, forced: Forced | None = None
                 ) -> GenerationResult:
        prompt, prompt_len, num_slots = self.pack(prompts)
        if forced is not None and forced.ref_tokens.shape[1] != num_slots:
            raise ValueError("forced reference was built for another slot count")
        key_p, key_d = jax.random.split(jax.random.PRNGKey(seed))
        cfg, gen = self.cfg, self.gen
        static = dict(cfg=cfg, gen=gen)
        # the prompt in its own program, the same for AR and every drafter (sequences.prompt_pass)
        taps = tuple(getattr(self.drafter, "taps", ()) or ())
        (cache, logits, features), c0, pass_s = self._run(
            "prompt_pass", prompt_pass, dict(cfg=cfg, taps=taps), params=self.params, prompt=prompt,
            prompt_len=prompt_len)
        start = dict(gen=gen, num_slots=num_slots)
        if self.drafter is None:
            (cache, seqs), c1, prefill_s = self._run(
                "ar_start", ar_start, start, cache=cache, logits=logits, prompt=prompt,
                prompt_len=prompt_len, key=key_p)
            (seqs, steps), c2, decode_s = self._run(
                "ar_decode", ar_decode, static, params=self.params, cache=cache, seqs=seqs, key=key_d)
            stats = None
        else:
            (cache, dstate, seqs), c1, prefill_s = self._run(
                "chain_start", chain_start, start, drafter=self.drafter, cache=cache, logits=logits,
                features=features, prompt=prompt, prompt_len=prompt_len, key=key_p)
        if self.drafter is not None:
            if forced is not None:
                from specjax.forcing import force_first_token
                forced, seqs = force_first_token(forced, seqs)
            if self.tree is not None:
                from specjax.decoding.tree import tree_decode
                (seqs, stats, forced), c2, decode_s = self._run(
                    "tree_decode", tree_decode, dict(static, tree=self.tree), target=self.params,
                    drafter=self.drafter, cache=cache, dstate=dstate, seqs=seqs, key=key_d, forced=forced)
            else:
                (seqs, stats, forced), c2, decode_s = self._run(
                    "chain_decode", chain_decode, static, target=self.params, drafter=self.drafter,
                    cache=cache, dstate=dstate, seqs=seqs, key=key_d, forced=forced)
            steps = int(np.max(np.asarray(stats.rounds)))
        compile_s, prefill_s = c0 + c1 + c2, pass_s + prefill_s
        tokens_np = np.asarray(seqs.tokens)
        length, plen = np.asarray(seqs.length), np.asarray(seqs.prompt_len)
        margins_np = np.asarray(seqs.margins)
        out_tokens, out_margins = [], []
        for b in range(len(prompts)):
            gen_tokens = tokens_np[b, plen[b]:length[b]].tolist()
            cut = min(len(gen_tokens), gen.max_new_tokens)
            if forced is None:
                for i, t in enumerate(gen_tokens[:cut]):
                    if t in gen.stop_tokens:
                        cut = i + 1
                        break
            out_tokens.append(gen_tokens[:cut])
            out_margins.append(margins_np[b, plen[b]:plen[b] + cut].tolist())
        return GenerationResult(
            tokens=out_tokens, margins=out_margins, prefill_s=prefill_s, decode_s=decode_s,
            compile_s=compile_s, steps=int(steps),
            rounds=None if stats is None else np.asarray(stats.rounds),
            accepted_hist=None if stats is None else np.asarray(stats.accepted_hist),
            forced=None if forced is None else jax.tree.map(np.asarray, dataclasses.asdict(forced)))
