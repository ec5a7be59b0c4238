"""Out-of-process evaluators: a hung candidate is killed and failed, a crashed worker is replaced, an
error fails one candidate only, and the search goes on (subprocess workers; Ray actors where ray is
installed)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from conftest import save_tiny_checkpoint
from specjax.costmodel.hardware import NOMINAL
from specjax.search.evaluate import Evaluator
from specjax.search.run import load_deployment, run_search
from specjax.search.spec import load_spec
from specjax.search.workers import ProcessHandle, RayHandle, RemoteEvaluator, remote_evaluator

SPEC = """\
version: 1
name: tiny-workers
deployment:
  target: {target}
  hardware: cpu
  prompts: {{source: file, path: prompts.jsonl, n: 2}}
  max_new_tokens: 12
stock: {{drafter.kind: ngram, drafter.k: 2, drafter.ngram_max_n: 2}}
space:
  drafter.kind: {{type: categorical, values: [none, ngram]}}
  drafter.k: {{type: int, range: [1, 4], when: {{drafter.kind: [ngram]}}}}
  drafter.ngram_max_n: {{type: int, range: [1, 2], when: {{drafter.kind: [ngram]}}}}
budget: {{rounds: 1, agents: 1, proposals_per_agent: 8, measure_per_round: 2, runs: 1, wall_clock_s: 600}}
evaluator: {{kind: subprocess, workers: {workers}, timeout_s: {timeout}}}
output: out
"""

HANG = {"drafter.kind": "ngram", "drafter.k": 3, "drafter.ngram_max_n": 2}
CRASH = {"drafter.kind": "ngram", "drafter.k": 2, "drafter.ngram_max_n": 1}
ERROR = {"drafter.kind": "ngram", "drafter.k": 4, "drafter.ngram_max_n": 1}
GOOD = {"drafter.kind": "ngram", "drafter.k": 1, "drafter.ngram_max_n": 2}
STOCK = {"drafter.kind": "ngram", "drafter.k": 2, "drafter.ngram_max_n": 2}


class MisbehavingEvaluator(Evaluator):
    """Imported by the workers by name: hangs, crashes or raises on chosen candidates."""

    def measure(self, config, runs, incumbent=None):
        if os.environ.get("SPECJAX_TEST_HANG_STOCK"):  # the search test: only the stock config hangs
            if config == STOCK:
                time.sleep(3600)
            return super().measure(config, runs, incumbent)
        if config == HANG:
            time.sleep(3600)
        if config == CRASH:
            os._exit(3)
        if config == ERROR:
            raise RuntimeError("injected failure")
        return super().measure(config, runs, incumbent)


FACTORY = f"{__name__}:MisbehavingEvaluator"


@pytest.fixture(scope="module")
def workers_spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    target = save_tiny_checkpoint(root / "target")
    (root / "prompts.jsonl").write_text('"abc abc abc ab"\n"hello hello hel"\n')

    def make(workers=1, timeout=40):
        path = root / f"spec{workers}_{timeout}.yaml"
        path.write_text(SPEC.format(target=target, workers=workers, timeout=timeout))
        return path
    return make


def test_subprocess_worker_survives_hang_crash_and_error(workers_spec, tmp_path):
    spec = load_spec(str(workers_spec(workers=1, timeout=40)))
    target, prompts = load_deployment(spec)
    ev = remote_evaluator(spec, target, prompts, NOMINAL["cpu"], "cpu", tmp_path, FACTORY)
    assert isinstance(ev.handles[0], ProcessHandle)
    try:
        jobs = [(GOOD, 1, None), (HANG, 1, None), (CRASH, 1, None), (ERROR, 1, None), (GOOD, 1, STOCK)]
        t = time.monotonic()
        results = ev.evaluate_many(jobs)
        elapsed = time.monotonic() - t
    finally:
        ev.close()
    (good, _), (hung, _), (crashed, _), (failed, _), (again, inc) = results
    assert good.valid and good.tokens_per_s > 0 and good.forcing["failures"] == 0
    assert not hung.valid and "timed out after 40 s" in hung.rejected and hung.tokens_per_s == 0
    assert not crashed.valid and "exited with code 3" in crashed.rejected
    assert not failed.valid and "injected failure" in failed.rejected
    assert again.valid and inc is not None and inc.config == STOCK  # a fresh worker took over
    assert ev.measurements == 5 and len(ev.failures) == 2  # the error answered; hang and crash did not
    assert elapsed < 40 + 300  # the hang cost its timeout, not an hour


def test_search_goes_on_after_a_hung_candidate(workers_spec, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_TEST_HANG_STOCK", "1")  # the stock config hangs in every worker
    # 60 s: a fresh worker's first candidate (JAX import + compile) took over 30 s on a loaded
    # 2-core runner, timed out like the hung stock, and left nothing measured
    spec = workers_spec(workers=2, timeout=60)
    lines = []
    state = run_search(str(spec), output=str(tmp_path / "out"), memory_dir=str(tmp_path / "mem"),
                       progress=lines.append, evaluator_factory=FACTORY)
    assert any("evaluator: subprocess, 2 workers" in line for line in lines)
    assert "timed out after 60 s" in state.stock["rejected"]
    assert state.round == 1 and state.incumbent["rejected"] is None  # AR stood in for the failed stock
    results = json.loads((tmp_path / "out" / "results.json").read_text())["payload"]
    measured = [r for r in results["evaluated"] if r["rejected"] is None and r["config"] != STOCK]
    assert measured, "no candidate was measured after the hang"
    assert (tmp_path / "out" / "workers" / "worker-0.log").exists()


def test_ray_actor_hang_is_killed_and_replaced(workers_spec, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu",  # actors import this module's factory
                                       "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    try:
        spec = load_spec(str(workers_spec(workers=1, timeout=40)))
        spec = spec.__class__(**{**spec.__dict__, "evaluator": spec.evaluator.__class__(kind="ray", workers=1,
                                                                                        timeout_s=40)})
        target, prompts = load_deployment(spec)
        ev = remote_evaluator(spec, target, prompts, NOMINAL["cpu"], "cpu", tmp_path, FACTORY)
        assert isinstance(ev, RemoteEvaluator) and isinstance(ev.handles[0], RayHandle)
        (hung, _), (good, _) = ev.evaluate_many([(HANG, 1, None), (GOOD, 1, None)])
        ev.close()
    finally:
        ray.shutdown()
    assert not hung.valid and "timed out after 40 s" in hung.rejected
    assert good.valid and good.tokens_per_s > 0
