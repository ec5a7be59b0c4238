"""`specjax bench`: the five prompt sets load from installed packages with their provenance; bad
configs are refused naming the field; the protocol reports speedups only for runs that pass token
forcing (a wrong engine is caught and gets none); the report is written and reads back; the CLI
runs end to end on SmolLM2."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from conftest import tiny_model
from specjax.atomic import read_json_checked
from specjax.bench import protocol
from specjax.bench.config import BenchConfig, Method, bench_config_from_dict, load_bench_config
from specjax.bench.prompt_sets import PROMPT_SETS, export_prompt_sets, load_set, read_prompt_file
from specjax.bench.report import markdown, write_report
from specjax.atomic import CorruptFileError
from specjax.errors import ConfigError
from specjax.models.loading import LoadedModel


def test_five_prompt_sets_load_with_provenance():
    assert len(PROMPT_SETS) == 5
    categories = set()
    for name, s in PROMPT_SETS.items():
        prompts = load_set(name, 8)
        assert len(prompts) == 8 and len(set(prompts)) == 8 and all(p.strip() for p in prompts)
        assert s.source and s.license and s.category
        categories.add(s.category)
    assert len(categories) == 5
    with pytest.raises(ConfigError, match="gsm8k_cot has 8 prompts, asked for 9"):
        load_set("gsm8k_cot", 9)
    with pytest.raises(ConfigError, match="unknown prompt set 'nope'"):
        load_set("nope", 1)


@pytest.mark.parametrize("raw,match", [
    ({"sets": {"humaneval": 2}}, "missing field deployment"),
    ({"deployment": "x", "sets": {"mbpp": 2}}, r"sets\.mbpp: unknown prompt set"),
    ({"deployment": "x", "sets": {"humaneval": 0}}, r"sets\.humaneval: expected an integer >= 1"),
    ({"deployment": "x", "methods": [{"name": "a", "drafter": "ngram"}]}, r"methods\[0\]: a method with a drafter needs k"),
    ({"deployment": "x", "methods": [{"name": "a", "tree": 4}]}, r"methods\[0\]\.tree: a tree needs a drafter"),
    ({"deployment": "x", "peers": ["vllm"]}, r"peers\[0\]: unknown peer 'vllm'"),
    ({"deployment": "x", "batchsize": [1]}, "batchsize: unknown field"),
    ({"deployment": "x", "kernels": "cuda"}, "kernels: expected one of auto, xla, pallas, interpret"),
    ({"deployment": "x", "methods": [{"name": "a", "kernels": "tpu"}]}, r"methods\[0\]\.kernels: expected one of"),
    ({"deployment": "x", "batch1_prompts": 0}, r"batch1_prompts: expected an integer >= 1"),
    ({"deployment": "x", "matmul_precision": "tf32"}, "matmul_precision: expected one of default, high, highest"),
])
def test_bad_configs_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        bench_config_from_dict(raw, "cfg.yaml")


def test_shipped_configs_load():
    for path in ("benchmarks/bench_cpu.yaml", "benchmarks/bench_h200.yaml"):
        cfg = load_bench_config(path)
        assert cfg.methods and dict(cfg.sets).keys() == PROMPT_SETS.keys()
    from pathlib import Path
    shipped = sorted(Path("benchmarks").glob("bench_*.yaml"))
    assert len(shipped) >= 7
    for path in shipped:  # every device config parses (a typo would cost a device call)
        assert load_bench_config(str(path)).methods, path


class _ByteTokenizer:
    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab for b in text.encode()[:24]]


def test_protocol_gates_speedups_on_token_forcing(monkeypatch):
    """The same n-gram method twice: as built, lossless with a speedup; with the target perturbed
    inside the engine, token forcing fails and no speedup is reported."""
    cfg, params = tiny_model(seed=3)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    make = protocol.make_decoder

    def maybe_wrong(model, method, gen, kernels):
        dec = make(model, method, gen, kernels)
        if method.name == "wrong":
            dec.params = jax.tree.map(lambda x: x * 1.05, dec.params)
        return dec
    monkeypatch.setattr(protocol, "make_decoder", maybe_wrong)
    bench = BenchConfig(deployment="t", sets=(("humaneval", 2),), max_new_tokens=10, repeats=2,
                        batch_sizes=(1, 2), methods=(Method("right", "ngram", 3), Method("wrong", "ngram", 3)))
    result = protocol.run_bench(model, bench, progress=lambda s: None)
    rows = {(r["method"], r["batch"]): r for r in result["rows"]}
    for batch in (1, 2):
        assert rows[("ar", batch)]["speedup"] == 1.0
        right, wrong = rows[("right", batch)], rows[("wrong", batch)]
        assert right["lossless"] is True and right["speedup"] > 0 and right["tau"] >= 1.0
        assert right["equal_to_ar"] == 2 and right["generated"] == 20
        assert wrong["lossless"] is False and wrong["speedup"] is None and "FAILED" in wrong["note"]
    table = markdown(dict(result, meta={}))
    assert "| humaneval | 1 | wrong |" in table and "**no**" in table and "failed the forcing gate" in table


def test_a_pass_with_near_tie_differences_is_reported_as_such(monkeypatch):
    """The gate lets near-ties differ; the report must not look bit-exact then."""
    from specjax.forcing import ForcingReport, Mismatch
    cfg, params = tiny_model(seed=3)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    tie = Mismatch(prompt=0, position=3, engine_token=5, reference_token=6, margin=1e-5)
    monkeypatch.setattr(protocol, "check_token_forcing", lambda dec, b, ref, tol: ForcingReport(
        tol, 10, 10, 1, [], [tie]))
    bench = BenchConfig(deployment="t", sets=(("humaneval", 1),), max_new_tokens=10, repeats=1,
                        batch_sizes=(1,), methods=(Method("ng", "ngram", 3),))
    result = protocol.run_bench(model, bench, progress=lambda s: None)
    row = next(r for r in result["rows"] if r["method"] == "ng")
    assert row["lossless"] is True and "1 near-tie differences" in row["note"]
    table = markdown(dict(result, meta={}))
    assert "passed the gate with near-tie differences" in table and "B=1 ng: passed with 1" in table


def test_report_is_written_and_reads_back(tmp_path):
    row = dict(set="pydoc", batch=1, method="ar", tokens_per_s=10.0, tokens_per_s_min=9.0, tokens_per_s_max=11.0,
               tau=None, lossless=None, speedup=1.0, equal_to_ar=1, prompts=1, generated=4, note="")
    spec = dict(row, method="ngram-4", tau=1.5, lossless=True, speedup=1.2)
    result = {"config": dataclasses.asdict(BenchConfig(deployment="t")), "meta": {"date": "d"},
              "sets": {"pydoc": {"name": "pydoc", "category": "summarization", "source": "s", "license": "PSF-2.0"}},
              "rows": [row, spec]}
    paths = write_report(result, tmp_path)
    assert read_json_checked(paths["json"])["rows"][1]["speedup"] == 1.2
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "| pydoc | 1 | ngram-4 | 10.0 | 9.0-11.0 | 1.50 | yes | 1.20x | 1/1 |" in paths["md"].read_text()


@pytest.mark.slow
def test_cli_runs_on_smollm2(tmp_path, capsys):
    from specjax.cli import main
    assert main(["bench", "--sets", "pydoc,gsm8k_cot", "--prompts", "1", "--max-new-tokens", "4",
                 "--repeats", "1", "--peers", "none", "--out", str(tmp_path)]) == 0
    result = read_json_checked(tmp_path / "bench.json")
    assert {r["set"] for r in result["rows"]} == {"pydoc", "gsm8k_cot"}
    assert all(r["lossless"] in (True, None) for r in result["rows"])
    assert "specjax bench: cpu-default" in capsys.readouterr().out
    assert main(["bench", "--sets", "mbpp"]) == 2


def test_prompt_file_carries_the_sets_and_refuses_damage(tmp_path):
    """A machine without the data packages runs from an exported prompt file: the same texts, and
    a damaged or foreign file is refused naming it."""
    path = tmp_path / "prompts.json"
    export_prompt_sets((("humaneval", 3), ("pydoc", 2)), path)
    exported = read_prompt_file(path)
    assert load_set("humaneval", 3, exported) == load_set("humaneval", 3)
    assert load_set("pydoc", 1, exported) == load_set("pydoc", 1)
    with pytest.raises(ConfigError, match=r"pydoc \(prompt file\) has 2 prompts, asked for 3"):
        load_set("pydoc", 3, exported)
    with pytest.raises(ConfigError, match="the prompt file has no set 'sharegpt'"):
        load_set("sharegpt", 1, exported)
    path.write_text(path.read_text().replace("def ", "deff ", 1))
    with pytest.raises(CorruptFileError, match="prompts.json: checksum mismatch"):
        read_prompt_file(path)
    with pytest.raises(ConfigError, match="nope.json: prompt file not found"):
        read_prompt_file(tmp_path / "nope.json")


def test_deadline_skips_units_and_parts_merge():
    """A deadline already passed runs nothing and lists every unit as skipped; results of one
    config run in parts merge, and parts of different configs are refused."""
    cfg, params = tiny_model(seed=3)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    bench = BenchConfig(deployment="t", sets=(("humaneval", 2), ("pydoc", 2)), max_new_tokens=6, repeats=1,
                        batch_sizes=(1, 2), methods=(Method("ngram", "ngram", 3), Method("ar-again")),
                        batch1_prompts=1)
    skipped = protocol.run_bench(model, bench, progress=lambda s: None, deadline=0.0)
    assert skipped["rows"] == [] and skipped["skipped"] == ["humaneval B=1", "humaneval B=2", "pydoc B=1", "pydoc B=2"]
    seen = []
    part = protocol.run_bench(model, dataclasses.replace(bench, sets=(("humaneval", 2),)), progress=lambda s: None,
                              partial=lambda r: seen.append((len(r["rows"]), r.get("unfinished"))))
    # written after each row, the unit marked unfinished until its last row, then after the unit
    assert seen == [(1, "humaneval B=1"), (2, "humaneval B=1"), (3, "humaneval B=1"), (3, None),
                    (4, "humaneval B=2"), (5, "humaneval B=2"), (6, "humaneval B=2"), (6, None)]
    assert "unfinished" not in part
    cut = dict(part, rows=part["rows"][:5], unfinished="humaneval B=2")  # a call's limit hit mid-unit
    kept, todo = protocol.units_to_resume(cut, bench)
    assert todo == {"humaneval B=2", "pydoc B=1", "pydoc B=2"} and "unfinished" not in kept
    assert [(r["set"], r["batch"]) for r in kept["rows"]] == [("humaneval", 1)] * 3
    rows = {(r["method"], r["batch"]): r for r in part["rows"]}
    assert rows[("ar", 1)]["prompts"] == 1 and rows[("ar", 2)]["prompts"] == 2  # batch1_prompts
    again = rows[("ar-again", 2)]  # an AR variant: timed, tokens compared, nothing to force
    assert again["lossless"] is None and again["equal_to_ar"] == 2 and again["speedup"] > 0
    merged = protocol.merge_results([part, skipped])
    assert len(merged["rows"]) == 6 and merged["skipped"] == skipped["skipped"]
    other = dict(part, config=dict(part["config"], max_new_tokens=7))
    with pytest.raises(ValueError, match="fields max_new_tokens"):
        protocol.merge_results([part, other])


def test_resume_runs_only_the_skipped_units():
    """A run cut short by its deadline, resumed: only the skipped units run, and the joined result
    holds every unit once, in the config's order (not the sorted order its file keeps); a resume under another config is refused."""
    cfg, params = tiny_model(seed=4)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    bench = BenchConfig(deployment="t", sets=(("pydoc", 2), ("humaneval", 2)), max_new_tokens=5, repeats=1,
                        batch_sizes=(1, 2), methods=(Method("ngram", "ngram", 3),), batch1_prompts=1)
    first = protocol.run_bench(model, bench, progress=lambda s: None, only_units={"pydoc B=1"})
    first["skipped"] = ["pydoc B=2", "humaneval B=1", "humaneval B=2"]  # as a deadline would list them
    first = json.loads(json.dumps(first, sort_keys=True))  # read back from its file: tuples as lists, keys sorted
    rest = protocol.run_bench(model, bench, progress=lambda s: None, only_units=set(first["skipped"]))
    assert {(r["set"], r["batch"]) for r in rest["rows"]} == {("pydoc", 2), ("humaneval", 1), ("humaneval", 2)}
    joined = protocol.resume_result(first, rest)
    units = [(r["set"], r["batch"]) for r in joined["rows"] if r["method"] == "ar"]
    assert units == [("pydoc", 1), ("pydoc", 2), ("humaneval", 1), ("humaneval", 2)] and joined["skipped"] == []
    with pytest.raises(ValueError, match="fields repeats"):
        protocol.resume_result(first, dict(rest, config=dict(rest["config"], repeats=2)))


def test_decoders_are_reused_across_sets(monkeypatch):
    """One decoder per (method, batch size) for the whole run, every batch of a set padded to one
    prompt bucket: a second set of the same bucket compiles nothing new (on a GPU the compiles,
    not the runs, are what a bench call spends its time on)."""
    cfg, params = tiny_model(seed=5)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    made = []

    def counted(*a, **kw):
        made.append(protocol.make_decoder_uncounted(*a, **kw))
        return made[-1]
    monkeypatch.setattr(protocol, "make_decoder_uncounted", protocol.make_decoder, raising=False)
    monkeypatch.setattr(protocol, "make_decoder", counted)
    bench = BenchConfig(deployment="t", sets=(("humaneval", 3),), max_new_tokens=5, repeats=1,
                        batch_sizes=(1, 2), methods=(Method("ngram", "ngram", 3),))
    protocol.run_bench(model, bench, progress=lambda s: None)
    one_set = (len(made), sum(len(d._compiled) for d in made))
    made.clear()
    result = protocol.run_bench(model, dataclasses.replace(bench, sets=(("humaneval", 3), ("pydoc", 3))),
                                progress=lambda s: None)
    assert (len(made), sum(len(d._compiled) for d in made)) == one_set == (4, one_set[1])
    assert {r["set"] for r in result["rows"]} == {"humaneval", "pydoc"}
    assert all(r["equal_to_ar"] == r["prompts"] for r in result["rows"])


def _record(target: str, hardware: str, k: int, speedup: float, batch: int = 1, **extra):
    from specjax.memory.store import MemoryRecord
    return MemoryRecord(
        spec_name="t", deployment={"target": target, "hardware": hardware, "batch": batch, "prompts": "p",
                                   "max_new_tokens": 8, "sampling": "greedy", "weight_format": "float32"},
        config={"drafter.kind": "ngram", "drafter.k": k, "drafter.ngram_max_n": 3, **extra},
        config_delta={"drafter.k": k, **extra},
        measured={"tokens_per_s": 10.0 * speedup, "speedup": speedup, "runs": 3, "device": hardware},
        predicted={"tokens_per_s": 10.0, "speedup": 1.0},
        forcing={"checked": 8, "expected": 8, "failures": 0, "near_ties": 0, "tolerance": 1e-3},
        git_commit="abc1234", device=hardware, created="2026-12-01T00:00:00Z")


def test_memory_method_runs_the_best_matching_record(tmp_path):
    """A `memory` method benches the searched config: the validated record of the best measured
    speedup whose deployment matches (another hardware's better record is not taken), gated by
    token forcing like any method; no matching record is a clear error."""
    from specjax.memory.store import MemoryStore
    cfg, params = tiny_model(seed=6)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    store = MemoryStore(tmp_path / "mem")
    store.put(_record("tiny", "cpu", 3, 1.2))
    best = store.put(_record("tiny", "cpu", 5, 1.4))
    store.put(_record("tiny", "h200", 9, 2.5))
    store.put(_record("other", "cpu", 7, 3.0))
    raw = {"deployment": "t", "model": "tiny", "sets": {"humaneval": 2}, "max_new_tokens": 6, "repeats": 1,
           "batch_sizes": [1],
           "methods": [{"name": "searched", "memory": {"hardware": "cpu"}}]}
    bench = bench_config_from_dict(raw)
    result = protocol.run_bench(model, bench, progress=lambda s: None, store=store)
    row = next(r for r in result["rows"] if r["method"] == "searched")
    assert row["lossless"] is True and row["equal_to_ar"] == 2 and best.record_id in row["note"]
    assert result["searched"]["searched"]["config"]["drafter.k"] == 5
    assert f"memory record {best.record_id}" in markdown(dict(result, meta={}))
    with pytest.raises(ConfigError, match="method searched: the memory store .* no validated record with "
                                          "hardware=tpu, target=tiny"):
        protocol.run_bench(model, bench_config_from_dict({**raw, "methods": [
            {"name": "searched", "memory": {"hardware": "tpu"}}]}), progress=lambda s: None, store=store)
    with pytest.raises(ConfigError, match=r"methods\[0\]: a memory method takes its mechanisms from the record; drop k"):
        bench_config_from_dict({**raw, "methods": [{"name": "s", "memory": {"hardware": "cpu"}, "k": 3}]})


def test_command_line_overrides_keep_every_method():
    """--sets/--prompts re-validate the config from its fields: every shipped method, a memory
    method included, must come back unchanged."""
    from specjax.bench.cli import _method_as_yaml
    from specjax.bench.config import _method
    for path in ("benchmarks/bench_h200_fp32.yaml", "benchmarks/bench_h200_bf16.yaml", "benchmarks/bench_h200.yaml",
                 "benchmarks/bench_cpu.yaml"):
        cfg = load_bench_config(path)
        assert tuple(_method(path, _method_as_yaml(m)) for m in cfg.methods) == cfg.methods
        assert any(m.memory for m in cfg.methods) or path.endswith("cpu.yaml")


def test_finish_by_skips_a_unit_that_would_overrun():
    """--finish-by-s: a unit is skipped when the last unit of its batch size would end past the
    limit, and a later, cheaper unit still runs (the skipped one is left for --resume)."""
    cfg, params = tiny_model(seed=7)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    bench = BenchConfig(deployment="t", sets=(("humaneval", 2), ("pydoc", 2)), max_new_tokens=4, repeats=1,
                        batch_sizes=(1, 2), methods=(), batch1_prompts=1)
    # unit starts and ends: humaneval B=1 0-100, B=2 100-150, pydoc B=1 would need 100 from 150, B=2 160-200
    ticks = iter([0.0, 100.0, 100.0, 150.0, 150.0, 160.0, 200.0])
    result = protocol.run_bench(model, bench, progress=lambda s: None, finish_by=240.0, clock=lambda: next(ticks))
    assert result["skipped"] == ["pydoc B=1"]
    assert [(r["set"], r["batch"]) for r in result["rows"]] == [("humaneval", 1), ("humaneval", 2), ("pydoc", 2)]


def test_a_searched_batching_config_runs_in_the_serving_engine(tmp_path):
    """A record whose config turns batching mechanisms on (and a tree) is benched through the
    continuous-batching engine with one slot per request of the batch, gated like any method."""
    from specjax.memory.store import MemoryStore
    from specjax.serving.decoder import ServingDecoder
    cfg, params = tiny_model(seed=6)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    store = MemoryStore(tmp_path / "mem")
    store.put(_record("tiny", "cpu", 3, 1.3, batch=2, **{"serving.packed": "on", "serving.steps_per_call": 4,
                                                         "tree.nodes": 4, "tree.builder": "topk"}))
    raw = {"deployment": "t", "model": "tiny", "sets": {"humaneval": 2}, "max_new_tokens": 6, "repeats": 1,
           "batch_sizes": [2], "methods": [{"name": "searched", "memory": {"hardware": "cpu", "batch": 2}}]}
    cache = protocol.DecoderCache(model, bench_config_from_dict(raw),
                                  protocol.searched_records(bench_config_from_dict(raw), store))
    dec = cache.get(bench_config_from_dict(raw).methods[0], 2, 16)
    assert isinstance(dec, ServingDecoder) and dec.num_slots == 2 and dec.options.tree is not None
    result = protocol.run_bench(model, bench_config_from_dict(raw), progress=lambda s: None, store=store)
    row = next(r for r in result["rows"] if r["method"] == "searched")
    assert row["lossless"] is True and row["equal_to_ar"] == 2


def test_a_mechanisms_method_runs_its_config_as_the_search_would():
    """A `mechanisms` method benches an explicit registry config (here batching mechanisms and an
    n-gram drafter) through the continuous-batching engine, gated like any method; an unknown
    parameter, a value outside its range, or a field beside the mapping is named in the error."""
    from specjax.serving.decoder import ServingDecoder
    cfg, params = tiny_model(seed=8)
    model = LoadedModel("tiny", cfg, params, _ByteTokenizer(cfg.vocab_size))
    mech = {"drafter.kind": "ngram", "drafter.k": 3, "drafter.ngram_max_n": 2, "serving.packed": "on",
            "serving.steps_per_call": 4}
    raw = {"deployment": "t", "model": "tiny", "sets": {"humaneval": 2}, "max_new_tokens": 6, "repeats": 1,
           "batch_sizes": [2], "methods": [{"name": "served", "mechanisms": mech}]}
    bench = bench_config_from_dict(raw)
    assert bench.methods[0].mechanisms == tuple(sorted(mech.items()))
    dec = protocol.DecoderCache(model, bench).get(bench.methods[0], 2, 16)
    assert isinstance(dec, ServingDecoder) and dec.num_slots == 2 and dec.drafter is not None
    result = protocol.run_bench(model, bench, progress=lambda s: None)
    row = next(r for r in result["rows"] if r["method"] == "served")
    assert row["lossless"] is True and row["equal_to_ar"] == 2 and row["tau"] is not None
    with pytest.raises(ConfigError, match=r"methods\[0\]\.mechanisms\.serving\.bogus: not a parameter"):
        bench_config_from_dict({**raw, "methods": [{"name": "s", "mechanisms": {"serving.bogus": 1}}]})
    with pytest.raises(ConfigError, match=r"methods\[0\]\.mechanisms\.drafter\.k: 99 is not allowed"):
        bench_config_from_dict({**raw, "methods": [{"name": "s", "mechanisms": {"drafter.k": 99}}]})
    with pytest.raises(ConfigError, match=r"methods\[0\]: a mechanisms method .* drop k"):
        bench_config_from_dict({**raw, "methods": [{"name": "s", "mechanisms": mech, "k": 3}]})


def test_compile_cache_keeps_compiled_programs(tmp_path):
    """--compile-cache: a program compiled once is written to the directory (so a later part of a
    run on the same machine loads it instead of compiling it again)."""
    from jax._src import compilation_cache
    from specjax.bench.cli import enable_compile_cache
    before = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                                              "jax_persistent_cache_min_entry_size_bytes")}
    try:
        compilation_cache.reset_cache()
        enable_compile_cache(str(tmp_path / "cache"))
        jax.jit(lambda a: a * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()
        assert any((tmp_path / "cache").iterdir())
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
