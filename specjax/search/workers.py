"""Measuring candidates outside the search's process: one subprocess per GPU, or one Ray actor per GPU.

Each worker loads the deployment itself (target, prompts, AR references) and serves requests
(`measure`, `evaluate` = measure + gates, `gate`, `acceptance_profile`) one at a time. The parent keeps
only the plan (cost-model dimensions, floors) and a pool of workers. Every request has a hard timeout:
a worker that does not answer in time is killed, the candidate is recorded as failed with the reason,
a fresh worker replaces it on next use, and the search goes on. A worker that crashes is treated the
same way; an exception inside a request fails only that candidate and the worker stays up.

Wire format (subprocess): one JSON object per line on the worker's stdin/stdout; everything the worker
prints goes to its log file instead (stdout is re-pointed at stderr).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specjax.search.evaluate import Measurement, Plan

DEFAULT_FACTORY = "specjax.search.evaluate:Evaluator"


class WorkerFailure(Exception):
    """The worker produced no answer for this request (timeout, crash, or an error in the request)."""


def resolve_factory(path: str):
    """'package.module:attr' -> the object (an Evaluator class or a function with its signature)."""
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"evaluator factory {path!r} must look like 'package.module:attr'")
    return getattr(importlib.import_module(module), attr)


# --------------------------------------------------------------------------- the worker's side

class WorkerCore:
    """Holds one in-process Evaluator and answers requests; used by the subprocess and Ray workers."""

    def __init__(self, init: dict):
        from specjax.costmodel.hardware import DeviceModel, current_device_name
        from specjax.search.run import load_deployment
        from specjax.search.spec import load_spec

        spec = load_spec(init["spec_path"])
        target, prompts = load_deployment(spec)
        factory = resolve_factory(init.get("factory") or DEFAULT_FACTORY)
        self.ev = factory(target, prompts, spec.deployment.max_new_tokens, DeviceModel(**init["cost_device"]),
                          current_device_name(), spec.forcing_tolerance, spec.floor_tolerance,
                          batch=spec.deployment.batch)
        self.ev.tp = spec.deployment.tp

    def handle(self, request: dict) -> dict:
        op, a = request["op"], request.get("args", {})
        try:
            if op == "ping":
                return {"ok": True, "device": self.ev.device_name}
            if op in ("measure", "evaluate"):
                m, inc = getattr(self.ev, op)(a["config"], a["runs"], a.get("incumbent"))
                return {"m": dataclasses.asdict(m), "inc": dataclasses.asdict(inc) if inc else None}
            if op == "gate":
                return {"m": dataclasses.asdict(self.ev.gate(Measurement(**a["m"])))}
            if op == "acceptance_profile":
                return {"alpha": self.ev.acceptance_profile(a["config"]).tolist()}
            return {"error": f"unknown request {op!r}"}
        except Exception as e:  # one candidate's failure must not take the worker down
            return {"error": f"{type(e).__name__}: {e}"}


def worker_main():
    """`python -m specjax.search.worker`: the subprocess worker's loop."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (JAX, libraries) go to the log, never into the protocol
    sys.stdout = os.fdopen(1, "w", buffering=1)
    init = json.loads(sys.stdin.readline())
    try:
        core = WorkerCore(init)
    except Exception as e:
        proto.write(json.dumps({"error": f"worker start failed: {type(e).__name__}: {e}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "device": core.ev.device_name}) + "\n")
    for line in sys.stdin:
        if line.strip():
            proto.write(json.dumps(core.handle(json.loads(line))) + "\n")
    return 0


# --------------------------------------------------------------------------- handles to one worker

class ProcessHandle:
    """One worker subprocess, pinned to one GPU through CUDA_VISIBLE_DEVICES."""

    def __init__(self, init: dict, gpu: str | None, log_path: Path, startup_timeout_s: float):
        self.init, self.gpu, self.log_path = init, gpu, log_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()

    def _start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # import what the parent imports
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "specjax.search.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                     start_new_session=True)  # its own group: a kill takes its children too
        log.close()
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        self._send(self.init)
        ready = self._receive(self.startup_timeout_s, "starting")
        if "error" in ready:
            self.kill()
            raise WorkerFailure(ready["error"])

    @staticmethod
    def _read(proc, lines):
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # EOF: the worker exited

    def _send(self, obj: dict):
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reader sees EOF and reports the exit

    def _receive(self, timeout_s: float, what: str) -> dict:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise WorkerFailure(f"timed out after {timeout_s:.0f} s {what}; worker killed") from None
        if line is None:
            code = self.proc.wait()
            self.proc = None
            raise WorkerFailure(f"worker exited with code {code} while {what} (log: {self.log_path})")
        return json.loads(line)

    def call(self, request: dict, timeout_s: float) -> dict:
        if self.proc is None:
            self._start()
        self._send(request)
        return self._receive(timeout_s, f"running {request['op']}")

    def kill(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    close = kill


class RayHandle:
    """One Ray actor holding a WorkerCore, with `num_gpus` GPUs reserved for it."""

    def __init__(self, init: dict, num_gpus: float, startup_timeout_s: float):
        import ray
        self.ray, self.init, self.num_gpus = ray, init, num_gpus
        self.startup_timeout_s = startup_timeout_s
        self.actor = None

    def _start(self):
        cls = self.ray.remote(num_gpus=self.num_gpus, max_restarts=0)(WorkerCore)
        self.actor = cls.remote(self.init)
        self._wait(self.actor.handle.remote({"op": "ping"}), self.startup_timeout_s, "starting")

    def _wait(self, ref, timeout_s: float, what: str) -> dict:
        ready, _ = self.ray.wait([ref], timeout=timeout_s)
        if not ready:
            self.kill()
            raise WorkerFailure(f"timed out after {timeout_s:.0f} s {what}; actor killed")
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            self.kill()
            first = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
            raise WorkerFailure(f"actor died while {what}: {type(e).__name__}: {first}") from None

    def call(self, request: dict, timeout_s: float) -> dict:
        if self.actor is None:
            self._start()
        return self._wait(self.actor.handle.remote(request), timeout_s, f"running {request['op']}")

    def kill(self):
        if self.actor is not None:
            self.ray.kill(self.actor, no_restart=True)
            self.actor = None

    close = kill


# --------------------------------------------------------------------------- the parent's side

class RemoteEvaluator(Plan):
    """The loop's evaluator when candidates run in workers: same methods as the in-process one."""

    def __init__(self, target, prompts, max_new_tokens, device, device_name, handles, timeout_s: float,
                 batch: int = 1):
        super().__init__(target, prompts, max_new_tokens, device, device_name, batch)
        self.handles, self.timeout_s = handles, timeout_s
        self.free: queue.Queue = queue.Queue()
        for h in handles:
            self.free.put(h)
        self.failures: list[str] = []

    def _call(self, op: str, **args) -> dict:
        handle = self.free.get()
        try:
            answer = handle.call({"op": op, "args": args}, self.timeout_s)
        except WorkerFailure as e:
            self.failures.append(f"{op} {args.get('config')}: {e}")
            raise
        finally:
            self.free.put(handle)
        if "error" in answer:
            raise WorkerFailure(f"failed in the worker: {answer['error']}")
        return answer

    def _pair(self, op: str, config: dict, runs: int, incumbent: dict | None):
        self.measurements += 1
        try:
            a = self._call(op, config=config, runs=runs, incumbent=incumbent)
        except WorkerFailure as e:
            return Measurement.failed(config, str(e), self.device_name), None
        return Measurement(**a["m"]), (Measurement(**a["inc"]) if a["inc"] else None)

    def measure(self, config, runs, incumbent=None):
        return self._pair("measure", config, runs, incumbent)

    def evaluate(self, config, runs, incumbent=None):
        return self._pair("evaluate", config, runs, incumbent)  # one round trip: gates run in the worker

    def evaluate_many(self, jobs):
        with ThreadPoolExecutor(max_workers=max(1, len(self.handles))) as pool:
            return list(pool.map(lambda job: self.evaluate(*job), jobs))

    def gate(self, m: Measurement) -> Measurement:
        if m.rejected:
            return m
        try:
            return Measurement(**self._call("gate", m=dataclasses.asdict(m))["m"])
        except WorkerFailure as e:
            return dataclasses.replace(m, rejected=f"gate: {e}")

    def acceptance_profile(self, config: dict):
        import numpy as np
        if config.get("drafter.kind", "none") == "none":
            return np.zeros(32)
        self.measurements += 1
        try:
            return np.asarray(self._call("acceptance_profile", config=config)["alpha"])
        except WorkerFailure as e:  # no profile: the loop then never screens this variant in
            self.failures.append(f"acceptance pilot {config}: {e}")
            return np.zeros(32)

    def close(self):
        for h in self.handles:
            h.close()


def gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries ([] on a CPU-only machine)."""
    import jax
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = len([d for d in jax.devices() if d.platform == "gpu"])
    if not n:
        return []
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()][:n]
    return [str(i) for i in range(n)]


def remote_evaluator(spec, target, prompts, cost_device, device_name, out_dir: Path,
                     factory: str | None = None) -> RemoteEvaluator:
    """The spec's `evaluator:` section -> a RemoteEvaluator with one worker per GPU (or as many as asked)."""
    es = spec.evaluator
    init = {"spec_path": str(Path(spec.path).resolve()), "cost_device": dataclasses.asdict(cost_device),
            "factory": factory or DEFAULT_FACTORY}
    if es.kind == "subprocess":
        gpus = gpu_ids()
        n = es.workers or max(1, len(gpus))
        handles = [ProcessHandle(init, gpus[i % len(gpus)] if gpus else None,
                                 out_dir / "workers" / f"worker-{i}.log", es.startup_timeout_s) for i in range(n)]
    elif es.kind == "ray":
        try:
            import ray
        except ImportError:
            raise ImportError("evaluator.kind: ray needs the ray extra: pip install 'specjax[ray]'") from None
        if not ray.is_initialized():
            ray.init(address=es.ray_address, include_dashboard=False, log_to_driver=False)
        cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
        n = es.workers or max(1, cluster_gpus)
        handles = [RayHandle(init, 1 if cluster_gpus else 0, es.startup_timeout_s) for _ in range(n)]
    else:
        raise ValueError(f"evaluator kind {es.kind!r} is not remote")
    return RemoteEvaluator(target, prompts, spec.deployment.max_new_tokens, cost_device, device_name,
                           handles, es.timeout_s, batch=spec.deployment.batch)
