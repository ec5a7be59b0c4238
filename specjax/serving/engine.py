"""The serving engine's host side: a request queue in front of the device state, `submit`,
`cancel`, `step` and streaming. Everything per token happens in `step.serve_call` on the device;
the host appends requests, names cancellations, and reads progress once per call."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from typing import Iterator

import jax
import numpy as np

from specjax.decoding.sequences import GenerationConfig
from specjax.errors import ConfigError
from specjax.models.target import is_hybrid
from specjax.sampling import SamplingConfig
from specjax.serving.paged_cache import pages_needed
from specjax.serving.state import Queue, ServingOptions, init_state
from specjax.serving.step import reserve, serve_call, serve_call_donating


class QueueFullError(ConfigError):
    """submit() while `max_waiting` requests already wait for a slot."""


@dataclasses.dataclass
class RequestResult:
    rid: int
    prompt: list[int]
    tokens: list[int]  # generated, cut after a stop token / at max_new_tokens
    status: str  # "finished", "cancelled" or "failed"
    error: str | None = None
    rounds: int = 0  # verify steps
    committed: int = 0  # tokens those steps committed
    accepted_hist: np.ndarray | None = None  # [k + 1] verify steps by drafts committed
    forced: dict | None = None  # forcing findings over the slot row (see serving/forcing.py)

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 1.0


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new: int
    reference: list[int] | None
    emitted: int = 0  # generated tokens handed out by `events`
    cancelled: bool = False


class ServingEngine:
    """Continuous batching over `num_slots` slots with a paged KV cache (docs/design/serving.md).

        engine = ServingEngine(cfg, params, NgramDrafter(k=4), num_slots=8)
        rid = engine.submit(prompt_ids, max_new_tokens=64)
        for token in engine.stream(rid): ...
        results = engine.run()          # or drive engine.step() from your own loop

    slot_len: tokens per slot (prompt + output + one step's overshoot must fit).
    num_pages: pages in the shared pool, the trash page included (default: every slot full).
    queue_len: requests the device holds ready to admit (default num_slots).
    max_waiting: requests the host queue holds before submit() refuses (QueueFullError).
    forcing: run every request forced along its `reference` (token forcing; greedy only).
    mesh: a "tp" mesh the target is split over (placed: params are already placed over it).
    """

    def __init__(self, cfg, params, drafter=None, *, num_slots: int = 4, slot_len: int = 256,
                 page_size: int = 16, num_pages: int | None = None, queue_len: int | None = None,
                 max_waiting: int = 1024, prompt_width: int | None = None,
                 sampling: SamplingConfig = SamplingConfig(), stop_tokens: tuple[int, ...] = (),
                 options: ServingOptions = ServingOptions(), seed: int = 0, forcing: bool = False,
                 mesh=None, shard_drafter: bool = False, placed: bool = False):
        if num_slots < 1 or slot_len < 2 or page_size < 1 or slot_len % page_size:
            raise ConfigError(f"need num_slots >= 1 and slot_len a multiple of page_size, got "
                              f"num_slots={num_slots}, slot_len={slot_len}, page_size={page_size}")
        if forcing and not sampling.greedy:
            raise ConfigError("token forcing compares greedy choices; use temperature 0")
        if options.attention != "xla" and page_size & (page_size - 1):
            raise ConfigError(f"attention={options.attention!r} (the paged attention kernel) needs page_size a "
                              f"power of two, got {page_size}")
        if options.attention == "pallas" and jax.devices()[0].platform != "gpu":
            raise ConfigError("attention='pallas' needs a GPU; use 'interpret' to run the kernel on a CPU, slowly")
        if mesh is not None:  # tensor parallelism: as engine.Decoder (docs/design/tensor_parallel.md)
            from specjax.sharding.tp import replicate, shard_params
            if not placed:  # placed: already split, GEMM kernel weights included (ServingDecoder)
                params = shard_params(params, mesh)[0]
            # the paged kernel (flat_forward, hybrid.py) and a hybrid target's attention and tree-GDN
            # kernels run split by heads
            if options.attention != "xla" or getattr(params, "kernels", "xla") != "xla":
                params = dataclasses.replace(params, mesh=mesh)
            if drafter is not None:
                drafter = shard_params(drafter, mesh)[0] if shard_drafter else replicate(drafter, mesh)
        self.cfg, self.params, self.drafter = cfg, params, drafter
        self.k = 0 if drafter is None else drafter.k
        self.options = options.check(self.k, num_slots)
        self.gen = GenerationConfig(max_new_tokens=slot_len, sampling=sampling, stop_tokens=tuple(stop_tokens))
        if self.options.tree is not None:
            from specjax.decoding.tree import check_tree_drafter
            check_tree_drafter(drafter, self.options.tree, self.gen)
        self.num_slots, self.slot_len, self.page_size = num_slots, slot_len, page_size
        self.num_pages = num_pages or num_slots * (slot_len // page_size) + 1
        self.queue_len = queue_len or num_slots
        self.prompt_width = prompt_width or slot_len // 2
        self.max_waiting, self.forcing = max_waiting, forcing
        self.state = init_state(cfg, drafter, num_slots, slot_len, page_size, self.num_pages,
                                self.queue_len, self.prompt_width, 2 * num_slots, seed)
        if is_hybrid(cfg):
            from specjax.serving.hybrid_step import init_recurrent, replay_width
            self.state = dataclasses.replace(self.state, recurrent=init_recurrent(
                cfg, num_slots, replay_width(self.options, self.k) if drafter is not None else 0))
        self._call = serve_call_donating if jax.devices()[0].platform == "gpu" else serve_call
        self._rids = itertools.count()
        self._waiting: deque[_Request] = deque()  # host side, not yet on the device
        self._device_queued = 0
        self._live: dict[int, _Request] = {}  # submitted, not finished
        self._cancel: set[int] = set()
        self.results: dict[int, RequestResult] = {}
        self.calls = self.steps = 0
        self.wall_s = 0.0

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: list[int], max_new_tokens: int, reference: list[int] | None = None) -> int:
        """Queue a request -> its id. reference (forcing mode): the AR continuation to force."""
        prompt = [int(t) for t in prompt]
        n = len(prompt)
        if n == 0:
            raise ConfigError("request has an empty prompt")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        if n > self.prompt_width:
            raise ConfigError(f"prompt has {n} tokens; this engine admits at most prompt_width="
                              f"{self.prompt_width}")
        over = self.options.overshoot(self.k)
        need = reserve(n, max_new_tokens, over)
        if need > self.slot_len:
            raise ConfigError(f"request needs {need} cache positions (prompt {n} + max_new_tokens "
                              f"{max_new_tokens} + {over + 1} for one step's drafts) but a slot holds "
                              f"slot_len={self.slot_len}")
        if n + max_new_tokens > self.cfg.max_position_embeddings:
            raise ConfigError(f"prompt {n} + max_new_tokens {max_new_tokens} exceeds the model context "
                              f"of {self.cfg.max_position_embeddings} tokens")
        if pages_needed(need, self.page_size) > self.num_pages - 1:
            raise ConfigError(f"request needs {pages_needed(need, self.page_size)} pages; the pool has "
                              f"{self.num_pages - 1}")
        if self.forcing and reference is None:
            raise ConfigError("forcing mode needs each request's reference continuation")
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests already wait (max_waiting="
                                 f"{self.max_waiting}); retry after some finish")
        req = _Request(next(self._rids), prompt, max_new_tokens, reference)
        self._waiting.append(req)
        self._live[req.rid] = req
        return req.rid

    def cancel(self, rid: int) -> None:
        """Stop a request wherever it is; its result gets status "cancelled" with the tokens
        generated so far. Other requests are not affected."""
        if rid not in self._live:
            return
        req = self._live[rid]
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish(req, [], "cancelled")
        else:
            req.cancelled = True
            self._cancel.add(rid)

    @property
    def idle(self) -> bool:
        return not self._live

    # ------------------------------------------------------------------ the loop

    def _inbox(self) -> Queue:
        Q, P, L = self.queue_len, self.prompt_width, self.slot_len
        arr = dict(tokens=np.zeros((Q, P), np.int32), length=np.zeros(Q, np.int32),
                   max_new=np.zeros(Q, np.int32), rid=np.full(Q, -2, np.int32),
                   ref_tokens=np.zeros((Q, L), np.int32), ref_length=np.zeros(Q, np.int32))
        n = 0
        while self._waiting and self._device_queued + n < Q:
            req = self._waiting.popleft()
            arr["tokens"][n, :len(req.prompt)] = req.prompt
            arr["length"][n], arr["max_new"][n], arr["rid"][n] = len(req.prompt), req.max_new, req.rid
            if req.reference is not None:
                seq = req.prompt + list(req.reference)
                arr["ref_tokens"][n, :len(seq)] = seq
                arr["ref_length"][n] = len(seq)
            n += 1
        return Queue(**{k: jax.numpy.asarray(v) for k, v in arr.items()}, count=jax.numpy.int32(n))

    def step(self) -> list[tuple[int, list[int], bool]]:
        """One device call (up to `options.steps_per_call` steps) -> events (rid, new tokens,
        finished) for every request that made progress."""
        t0 = time.perf_counter()
        cancel = np.full(self.num_slots + self.queue_len, -2, np.int32)
        ids = sorted(self._cancel)[:len(cancel)]
        cancel[:len(ids)] = ids
        self._cancel -= set(ids)
        self.state, steps = self._call(self.params, self.cfg, self.drafter, self.gen, self.options,
                                       self.forcing, self.state, self._inbox(), jax.numpy.asarray(cancel))
        s, q, o = self.state.slots, self.state.queue, self.state.outbox
        (steps, busy, rid, length, plen, tokens, qcount, ocount) = jax.device_get(
            (steps, s.busy, s.rid, s.seqs.length, s.seqs.prompt_len, s.seqs.tokens, q.count, o.count))
        self._device_queued = int(qcount)
        events = []
        for b in np.nonzero(busy)[0]:
            req = self._live.get(int(rid[b]))
            if req is not None:
                new = self._cut(req, tokens[b, plen[b]:length[b]].tolist())[req.emitted:]
                if new:
                    req.emitted += len(new)
                    events.append((req.rid, new, False))
        if ocount:
            out = jax.device_get(o)  # whole (fixed shape): slicing on the device compiles per count
            for i in range(int(ocount)):
                events.extend(self._retired(out, i))
        self.calls += 1
        self.steps += int(steps)
        self.wall_s += time.perf_counter() - t0
        return events

    def _cut(self, req: _Request, generated: list[int]) -> list[int]:
        cut = min(len(generated), req.max_new)
        if not self.forcing:
            for i, t in enumerate(generated[:cut]):
                if t in self.gen.stop_tokens:
                    return generated[:i + 1]
        return generated[:cut]

    def _retired(self, out, i: int):
        req = self._live.get(int(out.rid[i]))
        if req is None:
            return []
        lo, hi = int(out.prompt_len[i]), int(out.length[i])
        tokens = self._cut(req, out.tokens[i, lo:hi].tolist())
        if req.cancelled:
            status, error = "cancelled", None
        elif out.failed[i]:
            status, error = "failed", "non-finite logits (NaN or Inf) in the target's output for this request"
        else:
            status, error = "finished", None
        forced = None
        if self.forcing:
            forced = {k: np.asarray(getattr(out, k)[i]) for k in ("mismatch", "engine_token", "checked")}
        new = tokens[req.emitted:] if status != "failed" else []
        self._finish(req, tokens, status, error, int(out.rounds[i]), int(out.committed[i]), forced,
                     out.accepted_hist[i])
        return [(req.rid, new, True)]

    def _finish(self, req, tokens, status, error=None, rounds=0, committed=0, forced=None, hist=None):
        self._live.pop(req.rid, None)
        if hist is None:
            hist = np.zeros(self.k + 1, np.int64)
        self.results[req.rid] = RequestResult(req.rid, req.prompt, tokens, status, error, rounds,
                                              committed, np.asarray(hist), forced)

    def run(self, max_calls: int = 1_000_000) -> dict[int, RequestResult]:
        """Step until every submitted request has a result."""
        for _ in range(max_calls):
            if self.idle:
                break
            self.step()
        return self.results

    def stream(self, rid: int) -> Iterator[int]:
        """Yield request `rid`'s tokens as they are committed (driving `step`; other requests
        advance too, and their events are kept for their own streams)."""
        if rid not in self._live and rid not in self.results:
            raise ConfigError(f"unknown request id {rid}")
        given = 0
        while True:
            done = rid in self.results
            tokens = self.results[rid].tokens if done else self._progress(rid)
            yield from tokens[given:]
            given = len(tokens)
            if done:
                return
            self.step()

    def _progress(self, rid: int) -> list[int]:
        s = self.state.slots
        busy, rids, length, plen = jax.device_get((s.busy, s.rid, s.seqs.length, s.seqs.prompt_len))
        hit = np.nonzero(busy & (rids == rid))[0]
        if not len(hit):
            return []
        b = int(hit[0])
        row = jax.device_get(s.seqs.tokens[b])
        return self._cut(self._live[rid], row[plen[b]:length[b]].tolist())
