"""The benchmark protocol (docs/design/bench.md): per prompt set and batch size, greedy AR as the
reference, then every method warmed up, timed `repeats` times and gated by token forcing. A method
that fails the gate is reported without a speedup."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

from specjax.bench.config import BenchConfig, Method
from specjax.bench.prompt_sets import PROMPT_SETS, load_set
from specjax.decoding.sequences import GenerationConfig, prompt_bucket
from specjax.engine import Decoder, GenerationResult, pooled_tau
from specjax.errors import ConfigError
from specjax.forcing import check_token_forcing

WEIGHT_GROUPS = ("attn", "mlp", "head")


@dataclasses.dataclass
class Row:
    """One method on one prompt set at one batch size."""
    set: str
    batch: int
    method: str
    tokens_per_s: float  # median over repeats
    tokens_per_s_min: float
    tokens_per_s_max: float
    tau: float | None  # tokens per target step, bonus counted (None: not speculative)
    lossless: bool | None  # the forcing gate (None: not checked: AR itself, or a peer)
    speedup: float | None  # over AR's median, only where lossless (AR: 1.0)
    equal_to_ar: int  # prompts whose free-running tokens equal AR's
    prompts: int
    generated: int  # tokens per repeat
    note: str = ""


def chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def timed_runs(decoder: Decoder, batches: list[list[list[int]]], repeats: int
               ) -> tuple[list[float], list[GenerationResult]]:
    """Warm up (compile every batch shape), then `repeats` passes over all batches -> (tokens/s
    per pass, the last pass's results). Time = prefill + decode of each call."""
    for batch in batches:
        decoder.generate(batch)
    rates, results = [], []
    for _ in range(repeats):
        results = [decoder.generate(batch) for batch in batches]
        seconds = sum(r.prefill_s + r.decode_s for r in results)
        rates.append(sum(r.num_generated for r in results) / max(seconds, 1e-12))
    return rates, results


def make_decoder(model, method: Method, gen: GenerationConfig, kernels: str) -> Decoder:
    kernels = method.kernels or kernels
    drafter = tree = None
    if method.drafter is not None:
        from specjax.drafters.factory import make_drafter
        drafter = make_drafter(method.drafter, model, method.k)
    if method.tree is not None:
        from specjax.decoding.tree import default_builder
        from specjax.trees.builders import TreeSpec
        tree = TreeSpec.budget(default_builder(drafter), method.tree, method.k)
    fmt = {g: method.weights for g in WEIGHT_GROUPS} if method.weights != "bf16" else None
    return Decoder(model.cfg, model.params, gen, drafter, weights_format=fmt, kernels=kernels, tree=tree)


def searched_records(cfg: BenchConfig, store) -> dict[str, object]:
    """Each memory method's record: the validated record with the best measured speedup among
    those whose deployment has the method's fields and the bench's model as target."""
    out = {}
    for m in cfg.methods:
        if m.memory is None:
            continue
        want = dict(m.memory, target=cfg.model)
        found = store.matching(want)
        if not found:
            fields = ", ".join(f"{k}={v}" for k, v in sorted(want.items()))
            raise ConfigError(f"method {m.name}: the memory store {store.root} has no validated record "
                              f"with {fields} (run `specjax search` for that deployment, or "
                              f"`specjax memory list` to see what it holds)")
        out[m.name] = found[0]
    return out


def searched_decoder(model, config: dict, gen: GenerationConfig, kernels: str, batch: int = 1) -> Decoder:
    """A searched mechanism config (registry names, as a memory record keeps it) -> its Decoder;
    a config with batching mechanisms -> the continuous-batching engine behind the same
    interface (`ServingDecoder`, `batch` slots, the bench's GEMMs: `kernels`)."""
    from specjax.drafters.factory import make_drafter
    from specjax.search.evaluate import engine_changes
    from specjax.search.registry import REGISTRY
    kw = REGISTRY.apply(config)
    changes = engine_changes(config)
    drafter = None if kw["drafter"] is None else make_drafter(kw["drafter"], model, kw["k"])
    if "serving" in changes:
        from specjax.serving.decoder import ServingDecoder
        rest = sorted(set(changes) - {"serving", "tree", "kernels"})
        if rest:
            raise NotImplementedError(f"a searched batching config with {rest}: the serving engine "
                                      "reads bf16 weights")
        return ServingDecoder(model.cfg, model.params, gen, drafter, num_slots=batch,
                              options=changes["serving"], kernels=changes.get("kernels", kernels))
    changes.setdefault("kernels", kernels)
    return Decoder(model.cfg, model.params, gen, drafter, **changes)


def _row(set_name, batch, name, rates, results, ar_tokens, ar_rate, lossless, speculative, note=""):
    tokens = [t for r in results for t in r.tokens]
    med = statistics.median(rates)
    return Row(set=set_name, batch=batch, method=name, tokens_per_s=med, tokens_per_s_min=min(rates),
               tokens_per_s_max=max(rates), tau=pooled_tau(results) if speculative else None,
               lossless=lossless, speedup=(med / ar_rate if (lossless or lossless is None) and ar_rate else None),
               equal_to_ar=sum(a == b for a, b in zip(tokens, ar_tokens)), prompts=len(ar_tokens),
               generated=sum(r.num_generated for r in results), note=note)


class DecoderCache:
    """One Decoder per (method, batch size), reused over the prompt sets: a decoder keeps its
    compiled executables, so a set whose prompt bucket an earlier set had compiles nothing new
    (on a GPU, compiling a decode loop over Pallas kernels costs far more than running it)."""

    def __init__(self, model, cfg: BenchConfig, searched: dict | None = None):
        self.model, self.cfg, self._decoders = model, cfg, {}
        self.searched = searched or {}  # memory method name -> its record
        self.gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)  # no stop tokens: equal work per method

    def get(self, method: Method, batch: int, prompt_bucket: int) -> Decoder:
        key = (method.name, batch)
        if key not in self._decoders and method.memory is not None:
            self._decoders[key] = searched_decoder(self.model, self.searched[method.name].config, self.gen,
                                                   method.kernels or self.cfg.kernels, batch)
        elif key not in self._decoders and method.mechanisms is not None:
            self._decoders[key] = searched_decoder(self.model, dict(method.mechanisms), self.gen,
                                                   method.kernels or self.cfg.kernels, batch)
        elif key not in self._decoders:
            self._decoders[key] = make_decoder(self.model, method, self.gen, self.cfg.kernels)
        dec = self._decoders[key]
        dec.min_prompt_bucket = prompt_bucket
        return dec


def run_set(model, cfg: BenchConfig, set_name: str, n: int, batch: int,
            progress: Callable[[str], None] = print, peers: dict | None = None,
            exported: dict[str, list[str]] | None = None, decoders: DecoderCache | None = None,
            on_row: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """All methods (and peers, at batch 1) on one prompt set at one batch size. Every batch of
    the set is padded to the bucket of its longest prompt: one compiled shape per set and method.
    on_row(rows so far): after each row (a device call cut inside a unit keeps them)."""
    def report(rows):
        if on_row is not None:
            on_row(rows)
    if batch == 1 and cfg.batch1_prompts:
        n = min(n, cfg.batch1_prompts)
    texts = load_set(set_name, n, exported)
    prompts = [model.tokenizer.encode(t) for t in texts]
    batches = chunks(prompts, batch)
    bucket = prompt_bucket(max(len(p) for p in prompts))
    decoders = decoders or DecoderCache(model, cfg)
    t0 = time.perf_counter()
    ar = decoders.get(Method("ar"), batch, bucket)
    rates, ar_results = timed_runs(ar, batches, cfg.repeats)
    ar_tokens = [t for r in ar_results for t in r.tokens]
    ar_rate = statistics.median(rates)
    rows = [_row(set_name, batch, "ar", rates, ar_results, ar_tokens, ar_rate, None, False)]
    progress(f"{set_name} B={batch} ar: {ar_rate:.1f} tok/s ({time.perf_counter() - t0:.0f} s, prompt bucket {bucket})")
    report(rows)
    for method in cfg.methods:
        t0 = time.perf_counter()
        dec = decoders.get(method, batch, bucket)
        if dec.drafter is None:  # AR with other kernels or 12-bit weights: nothing to force
            lossless, note = None, "AR variant: tokens equal to the reference AR counted"
        else:
            reports = [check_token_forcing(dec, b, ref, cfg.tolerance) for b, ref in zip(batches, ar_results)]
            lossless = all(r.passed for r in reports)
            ties = sum(len(r.near_tie_mismatches) for r in reports)
            note = "" if lossless else "FAILED token forcing: " + "; ".join(
                r.summary() for r in reports if not r.passed)
            if lossless and ties:  # passed, but not bit for bit: say so beside "lossless"
                note = (f"passed with {ties} near-tie differences (margin < {cfg.tolerance:g}) in "
                        f"{sum(r.checked for r in reports)} positions")
        if method.memory is not None:
            record = decoders.searched[method.name].record_id
            note = f"searched config: memory record {record}" + (f"; {note}" if note else "")
        rates, results = timed_runs(dec, batches, cfg.repeats)
        rows.append(_row(set_name, batch, method.name, rates, results, ar_tokens, ar_rate, lossless,
                         dec.drafter is not None, note))
        r = rows[-1]
        progress(f"{set_name} B={batch} {method.name}: {r.tokens_per_s:.1f} tok/s, tau {r.tau or 1:.2f}, "
                 f"{ {True: 'lossless', False: 'NOT LOSSLESS', None: 'AR variant'}[lossless]} "
                 f"({time.perf_counter() - t0:.0f} s)")
        report(rows)
    if batch == 1 and peers:
        for name, peer in peers.items():
            rates, tokens = peer.timed(prompts, cfg.max_new_tokens, cfg.peer_repeats or cfg.repeats)
            med = statistics.median(rates)
            rows.append(Row(set=set_name, batch=1, method=name, tokens_per_s=med, tokens_per_s_min=min(rates),
                            tokens_per_s_max=max(rates), tau=None, lossless=None, speedup=med / ar_rate,
                            equal_to_ar=sum(a == b for a, b in zip(tokens, ar_tokens)), prompts=len(prompts),
                            generated=sum(len(t) for t in tokens), note="another implementation: equality counted"))
            progress(f"{set_name} B=1 {name}: {med:.1f} tok/s, {rows[-1].equal_to_ar}/{len(prompts)} equal to ar")
            report(rows)
    return rows


def run_bench(model, cfg: BenchConfig, progress: Callable[[str], None] = print,
              exported: dict[str, list[str]] | None = None, deadline: float | None = None,
              partial: Callable[[dict], None] | None = None, only_units: set[str] | None = None,
              store=None, finish_by: float | None = None, clock: Callable[[], float] = time.monotonic) -> dict:
    """Every (set, batch size) of the config in order. deadline (clock()): units not started by
    then are listed under "skipped"; finish_by (clock()): a unit is skipped too when the last unit
    of its batch size (else the longest one so far), run again, would end after it, so a device
    call's time limit never cuts a unit off (later, cheaper units may still fit). partial(result)
    after each row (so a run cut short keeps what it measured; a unit in progress is named under
    "unfinished", which `units_to_resume` runs again whole) and after each unit. only_units: run just these ("humaneval B=32", the form
    "skipped" lists), for resuming a run cut short. store: the MemoryStore memory methods (the
    searched configs) read their records from."""
    searched = {}
    if any(m.memory is not None for m in cfg.methods):
        if store is None:
            raise ConfigError("this bench config has memory methods: give run_bench a memory store")
        searched = searched_records(cfg, store)
    peers = {}
    if cfg.peers:
        from specjax.bench.peer import make_peers
        peers = make_peers(model, cfg.peers, cfg.dtype)
    result = {"config": dataclasses.asdict(cfg),
              "sets": {name: {k: v for k, v in dataclasses.asdict(PROMPT_SETS[name]).items() if k != "load"}
                       for name, _ in cfg.sets},
              "rows": [], "skipped": []}
    if searched:  # what each searched method ran: its record and mechanisms
        result["searched"] = {name: {"record_id": r.record_id, "config": r.config, "deployment": r.deployment,
                                     "measured": r.measured, "device": r.device}
                              for name, r in searched.items()}
    decoders = DecoderCache(model, cfg, searched)
    seconds: dict[int, float] = {}  # batch size -> how long its last unit took
    for set_name, n in cfg.sets:
        for batch in cfg.batch_sizes:
            if only_units is not None and f"{set_name} B={batch}" not in only_units:
                continue
            now = clock()
            estimate = seconds.get(batch, max(seconds.values(), default=0.0))
            if (deadline is not None and now > deadline) or (finish_by is not None and now + estimate > finish_by):
                result["skipped"].append(f"{set_name} B={batch}")
                progress(f"deadline: skipping {set_name} B={batch}")
                continue
            unit = f"{set_name} B={batch}"

            def on_row(rows, unit=unit):  # the unit's rows so far, marked unfinished
                partial(dict(result, rows=result["rows"] + [dataclasses.asdict(r) for r in rows], unfinished=unit))
            rows = run_set(model, cfg, set_name, n, batch, progress, peers, exported, decoders,
                           on_row if partial is not None else None)
            seconds[batch] = clock() - now
            result["rows"] += [dataclasses.asdict(r) for r in rows]
            if partial is not None:
                partial(result)
    return result


def units_to_resume(previous: dict, cfg: BenchConfig) -> tuple[dict, set[str]]:
    """A partial result -> (it without the rows of a unit a time limit cut off, the units to run:
    every unit of `cfg` without rows: the ones a deadline skipped and the cut one, run again whole)."""
    cut = previous.get("unfinished")
    unit = lambda r: f"{r['set']} B={r['batch']}"  # noqa: E731
    kept = {k: v for k, v in previous.items() if k != "unfinished"}
    kept["rows"] = [r for r in previous.get("rows", []) if unit(r) != cut]
    done = {unit(r) for r in kept["rows"]}
    return kept, {f"{n} B={b}" for n, _ in cfg.sets for b in cfg.batch_sizes} - done


def resume_result(previous: dict, resumed: dict) -> dict:
    """A partial result and the run of its skipped units (same config) -> one result: the rows of
    both, in the config's order of sets; skipped what the second run still skipped."""
    import json
    before, now = (json.loads(json.dumps(r["config"])) for r in (previous, resumed))  # tuples read back as lists
    if before != now:
        diff = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        raise ValueError(f"the resumed run has another config (fields {', '.join(diff)})")
    from specjax.bench.report import in_config_order
    meta = dict(previous.get("meta", {}), parts=[previous.get("meta", {}), resumed.get("meta", {})])
    return in_config_order(dict(previous, rows=previous["rows"] + resumed["rows"],
                                sets={**previous["sets"], **resumed["sets"]},
                                skipped=list(resumed.get("skipped", [])), meta=meta))


def merge_results(results: list[dict]) -> dict:
    """Bench results of one config run in parts (say, its sets over two device calls) -> one
    result. The parts must share everything but their sets; rows keep their order."""
    if not results:
        raise ValueError("nothing to merge")
    base = {k: v for k, v in results[0]["config"].items() if k != "sets"}
    for i, r in enumerate(results[1:], 1):
        other = {k: v for k, v in r["config"].items() if k != "sets"}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise ValueError(f"part {i} was run with another config (fields {', '.join(diff)})")
    merged = {"config": dict(results[0]["config"], sets=[s for r in results for s in r["config"]["sets"]]),
              "sets": {k: v for r in results for k, v in r["sets"].items()},
              "rows": [row for r in results for row in r["rows"]],
              "skipped": [s for r in results for s in r.get("skipped", [])]}
    merged["meta"] = dict(results[0].get("meta", {}), parts=[r.get("meta", {}) for r in results])
    return merged
