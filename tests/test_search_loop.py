"""The search loop end to end on a tiny checkpoint, its gates against injected reward hacks, and
resuming after kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

import specjax.decoding.chain as chain_module
from conftest import save_tiny_checkpoint, shared_cpu_device_model
from specjax.memory.store import MemoryStore
from specjax.models.config import ModelConfig
from specjax.models.loading import LoadedModel
from specjax.models.params import init_random_params
from specjax.search.evaluate import Evaluator
from specjax.search.run import run_search

SPEC = """\
version: 1
name: tiny
deployment:
  target: {target}
  hardware: cpu
  prompts: {{source: file, path: prompts.jsonl, n: 2}}
  max_new_tokens: 16
stock: {{drafter.kind: ngram, drafter.k: 2, drafter.ngram_max_n: 2}}
space:
  drafter.kind: {{type: categorical, values: [none, ngram, layerskip]}}
  drafter.k: {{type: int, range: [1, 4], when: {{drafter.kind: [ngram, layerskip]}}}}
  drafter.ngram_max_n: {{type: int, range: [1, 2], when: {{drafter.kind: [ngram]}}}}
  drafter.layers: {{type: int, values: [1], when: {{drafter.kind: [layerskip]}}}}
budget: {{rounds: {rounds}, agents: 2, proposals_per_agent: 6, measure_per_round: 2, runs: 2, wall_clock_s: 600}}
output: out
"""


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    target = save_tiny_checkpoint(root / "target")
    (root / "prompts.jsonl").write_text('"abc abc abc ab"\n"hello hello hel"\n')
    def make(rounds):
        path = root / f"spec{rounds}.yaml"
        path.write_text(SPEC.format(target=target, rounds=rounds))
        return root, path
    return make


def test_search_end_to_end(tiny_spec, tmp_path):
    root, spec = tiny_spec(2)
    lines = []
    state = run_search(str(spec), output=str(tmp_path / "out"), memory_dir=str(tmp_path / "mem"),
                       progress=lines.append)
    results = json.loads((tmp_path / "out" / "results.json").read_text())["payload"]
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Search report: tiny")
    assert results["ar_tokens_per_s"] > 0 and len(results["rounds"]) == 2
    for row in results["evaluated"]:  # every measured speculative candidate went through forcing
        if row["config"].get("drafter.kind") == "none":
            assert row["forcing"] is None  # plain AR is the reference itself: nothing to force
        else:
            assert row["rejected"] is not None or row["forcing"]["failures"] == 0
    records, corrupt = MemoryStore(tmp_path / "mem").records()
    assert not corrupt and len(records) == len(state.records) >= 1
    assert all(r.forcing["failures"] == 0 and r.forcing["checked"] == r.forcing["expected"] for r in records)
    assert any("round 1" in line for line in lines)


# --------------------------------------------------------------------------- reward hacks

@pytest.fixture(scope="module")
def hack_setup():
    """A 77 MB random target: big enough that its physical floor is far above timer noise."""
    cfg = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_layers=4, num_heads=8,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    target = LoadedModel("random", cfg, init_random_params(cfg, jax.random.PRNGKey(0), scale=0.05), None)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [7, 8, 9, 7, 8, 9]]
    return target, prompts, shared_cpu_device_model()


CONFIG = {"drafter.kind": "ngram", "drafter.k": 3, "drafter.ngram_max_n": 2}


def test_honest_candidate_passes_both_gates(hack_setup):
    target, prompts, dev = hack_setup
    ev = Evaluator(target, prompts, 24, dev, "cpu")
    m = ev.gate(ev.measure(CONFIG, runs=2)[0])
    assert m.valid, m.rejected
    assert m.run_s >= m.floor_s


def test_hack_skipping_verification_is_rejected(hack_setup, monkeypatch):
    target, prompts, dev = hack_setup

    def accept_everything(draft, target_logits):
        B, k = draft.shape
        return jax.numpy.full((B,), k, jax.numpy.int32), jax.numpy.concatenate(
            [draft, jax.numpy.argmax(target_logits[:, -1:], -1).astype(jax.numpy.int32)], axis=1)

    ev = Evaluator(target, prompts, 24, dev, "cpu")  # reference built before the hack
    monkeypatch.setattr(chain_module, "greedy_accept", accept_everything)
    jax.clear_caches()
    try:
        m = ev.gate(ev.measure(CONFIG, runs=1)[0])
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert not m.valid and "token forcing" in m.rejected


def test_hack_returning_cached_outputs_is_rejected(hack_setup):
    target, prompts, dev = hack_setup
    ev = Evaluator(target, prompts, 24, dev, "cpu")

    class Cached:  # replays the reference tokens without running the model
        drafter, gen = object(), ev.gen

        def generate(self, batch, seed=0, forced=None):
            ref = next(r for b, r in zip(ev.batches, ev.references) if b == batch)
            return ref

    ev.build_decoder = lambda config: Cached()
    m = ev.measure(CONFIG, runs=2)[0]
    assert not m.valid and "under the physical floor" in m.rejected


def test_hack_timer_that_under_reports_is_rejected(hack_setup):
    target, prompts, dev = hack_setup
    # Reports 1/10000 of the real time: on any machine, however slow, far under the floor (a /50 timer
    # slipped past the floor on a loaded 2-core CI runner, where the real run took 0.94 s).
    ev = Evaluator(target, prompts, 24, dev, "cpu", timer=lambda: time.perf_counter() / 10_000)
    m = ev.measure(CONFIG, runs=2)[0]
    assert not m.valid and "under the physical floor" in m.rejected


# --------------------------------------------------------------------------- kill -9, then --resume

def test_kill_then_resume_loses_no_validated_record(tiny_spec, tmp_path):
    root, spec = tiny_spec(3)
    out, mem = tmp_path / "out", tmp_path / "mem"
    cmd = [sys.executable, "-m", "specjax.cli", "search", str(spec), "--output", str(out), "--memory", str(mem)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    deadline = time.time() + 300
    before = []
    while time.time() < deadline:  # kill once a validated record exists and the loop is mid-round
        state = out / "state.json"
        if state.exists() and json.loads(state.read_text())["payload"]["records"] and \
                len(json.loads(state.read_text())["payload"]["evaluated"]) >= 2:
            before = [r.record_id for r in MemoryStore(mem).records()[0]]
            proc.send_signal(signal.SIGKILL)
            break
        if proc.poll() is not None:
            pytest.fail("search ended before it could be killed:\n" + proc.stdout.read())
        time.sleep(0.2)
    proc.wait()
    assert before, "no validated record appeared in time"
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at round" in resumed.stdout
    records, corrupt = MemoryStore(mem).records()
    assert not corrupt and set(before) <= {r.record_id for r in records}
    assert json.loads((out / "state.json").read_text())["payload"]["round"] == 3


HYBRID_SPEC = """\
version: 1
name: tiny-hybrid
deployment:
  target: {target}
  hardware: cpu
  prompts: {{source: file, path: prompts.jsonl, n: 2}}
  max_new_tokens: 12
stock: {{drafter.kind: ngram, drafter.k: 2, drafter.ngram_max_n: 2, tree.nodes: 0, tree.builder: topk}}
space:
  drafter.kind: {{type: categorical, values: [none, ngram]}}
  drafter.k: {{type: int, range: [2, 4], when: {{drafter.kind: [ngram]}}}}
  drafter.ngram_max_n: {{type: int, range: [1, 2], when: {{drafter.kind: [ngram]}}}}
  tree.nodes: {{type: int, values: [0, 4], when: {{drafter.kind: [ngram]}}}}
  tree.builder: {{type: categorical, values: [topk], when: {{drafter.kind: [ngram]}}}}
budget: {{rounds: 1, agents: 2, proposals_per_agent: 6, measure_per_round: 2, runs: 1, wall_clock_s: 600}}
output: out
"""


def test_search_on_a_hybrid_target(tmp_path):
    """A Qwen3-Next checkpoint as the deployment's target: the cost model's hybrid terms, trees
    and chains measured, every winner gated by token forcing."""
    target = save_tiny_checkpoint(tmp_path / "target", num_layers=4, hybrid=True)
    (tmp_path / "prompts.jsonl").write_text('"abc abc abc ab"\n"hello hello hel"\n')
    spec = tmp_path / "spec.yaml"
    spec.write_text(HYBRID_SPEC.format(target=target))
    run_search(str(spec), output=str(tmp_path / "out"), memory_dir=str(tmp_path / "mem"))
    results = json.loads((tmp_path / "out" / "results.json").read_text())["payload"]
    measured = [r for r in results["evaluated"] if r["config"].get("drafter.kind") == "ngram"]
    assert measured and all(r["rejected"] is not None or r["forcing"]["failures"] == 0 for r in measured)


def test_batching_mechanisms_build_the_serving_engine_and_pass_the_gate(hack_setup):
    """A config with batching mechanisms runs on the continuous-batching engine, is measured
    and passes token forcing; the registry turns the YAML knobs into ServingOptions."""
    from specjax.search.registry import REGISTRY
    from specjax.serving.decoder import ServingDecoder
    target, prompts, dev = hack_setup
    config = dict(CONFIG, **{"serving.budget": 4, "serving.packed": "on", "serving.steps_per_call": 4,
                             "serving.two_level_k1": 1})
    opts = REGISTRY.apply(config)["serving"]
    assert (opts.budget, opts.packed, opts.steps_per_call, opts.two_level_k1) == (4, True, 4, 1)
    assert REGISTRY.apply(CONFIG)["serving"] is None
    ev = Evaluator(target, prompts, 24, dev, "cpu", batch=2)
    assert isinstance(ev.decoder(config), ServingDecoder)
    m = ev.gate(ev.measure(config, runs=1)[0])
    assert m.valid, m.rejected
    assert m.forcing["checked"] == m.forcing["expected"] > 0
