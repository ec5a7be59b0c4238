"""Kernel sub-agent: per-device tile configs of the skinny GEMMs (pallas_kernels/skinny_gemm*.py)
for the GEMM shapes of a model, cached in memory_store/kernels/<device>.json.

For each [in, out] shape (w_qkv, w_o, w_gate_up, w_down, lm_head) it times the current configs
(cached, else the untuned default, `default_tiles`) for bf16 and LH12 at T = 1 and 16 (decode and verify widths), takes
the effective bandwidth (bf16 bytes 2 K N / time) and the gap to the read ceiling, then sweeps
candidates for the shapes furthest from the ceiling first, each given a share of the time budget
in proportion to its gap: first the numerics (block_k, split_k) with each format's current speed
settings, then block_n / num_warps / num_stages per format for the two best numerics.

Numerics rule: a shape has ONE (block_k, split_k) for bf16 and LH12 and for every T. Those two fix
the reduction order (pallas_kernels/skinny_gemm.py); block_n, num_warps and num_stages do not.
The engine's losslessness rests on it: an AR step (T = 1) and a verify step (T = k + 1) must
compute bit-identical logits for the same position, or speculative decoding would emit tokens
plain AR would not; and a 12-bit target must give exactly the bf16 target's tokens. So the best
pair is chosen as a pair, never the best config of each format or width on its own.

Wide steps (T > 16 rows, `GemmConfig.wide`): once a shape has its pair, `run_wide` times other
speed settings at T = 64 under the pair's numerics and weight layout and keeps, per format, the
fastest when it beats the pair's own by WIDE_MIN_GAIN; the numerics never change, so the rule
above holds.

The timer is injectable, `time_fn(shape, fmt, config, T) -> seconds per call` (and a `clock` for
the budget), so the logic is tested on a CPU with fake timers; the real one is
specjax/search/kernel_timer.py and needs a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time
import zlib
from pathlib import Path
from typing import Callable

import jax

from pallas_kernels.skinny_gemm import STRIPES, GemmConfig, Geometry, check_layout
from specjax.atomic import CorruptFileError, read_json_checked, write_json_atomic
from specjax.errors import ConfigError
from specjax.search.registry import LH12_NOMINAL_BITS

FORMATS = ("bf16", "lh12")
TOKENS = (1, 16)  # decode steps (AR, drafters) and verify steps
DEFAULT_CEILING = 4.07e12  # H200 read bandwidth (costmodel/hardware.py NOMINAL["h200"])
CACHE_VERSION = 1

# Candidate space. Programs: >= 2 per SM of an H100/H200 (132 SMs) keeps every SM busy through a
# program's tail; split_k buys them for narrow outputs. K padded past 1/8 wastes reads: skipped.
BLOCK_N = (128, 256, 512)
BLOCK_K = (64, 128, 32, 256)  # likeliest first: the default's 64
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)
LH12_DECODES = ("prmt", "swar")
LH12_BLOCK_N = (128, 256)  # 512 spilled registers on the H200 (0.6-0.8 TB/s)
LH12_LOOKUPS = ("masked", "superword")
MIN_PROGRAMS = 2 * 132
MAX_K_PADDING = 1.125
SPEED_NUMERICS = 2  # numerics whose speed settings get the full sweep
WIDE_TOKENS = 64  # the widest step the kernels serve (specjax/models/linear.py SLAB)
WIDE_MIN_GAIN = 0.02  # a wide config must beat the pair's own settings at T = 64 by this much

TimeFn = Callable[[tuple[int, int], str, GemmConfig, int], float]
Shape = tuple[int, int]


# ----------------------------------------------------------------------------- shapes

def shape_key(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def parse_shapes(text: str) -> list[Shape]:
    """'4096x4096,4096x14336' -> [(4096, 4096), (4096, 14336)] ([in, out] of x @ W)."""
    shapes = []
    for part in text.split(","):
        k, sep, n = part.strip().lower().partition("x")
        if not (sep and k.isdigit() and n.isdigit() and int(k) > 0 and int(n) > 0):
            raise ConfigError(f"--shapes: {part.strip()!r} is not INxOUT (e.g. 4096x14336)")
        if (int(k), int(n)) not in shapes:
            shapes.append((int(k), int(n)))
    return shapes


def model_shapes(cfg) -> list[Shape]:
    """[in, out] of w_qkv, w_o, w_gate_up, w_down and lm_head of a ModelConfig, without repeats."""
    d = cfg.hidden_size
    out = []
    for s in ((d, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, d), (d, 2 * cfg.intermediate_size),
              (cfg.intermediate_size, d), (d, cfg.vocab_size)):
        if s not in out:
            out.append(s)
    return out


# ----------------------------------------------------------------------------- candidates

def _split_for(shape: Shape, block_k: int, block_n: int) -> int:
    """Fewest K splits that give MIN_PROGRAMS programs (within 2x of that, the least K padding)."""
    k, n = shape
    programs = -(-(-(-n // STRIPES)) // (block_n // STRIPES))
    need = -(-MIN_PROGRAMS // programs)
    most = max(1, k // block_k)  # every split keeps at least one K step
    if need <= 1:
        return 1
    need = min(need, most)
    return min(range(need, min(2 * need, most) + 1), key=lambda s: (-(-k // (block_k * s)) * block_k * s, s))


def numerics_candidates(shape: Shape) -> list[tuple[int, int]]:
    """(block_k, split_k) pairs worth timing on a shape, likeliest first: per block_k the split
    that fills the GPU at the default block_n, then no split."""
    out = []
    for bk in BLOCK_K:
        for split in (_split_for(shape, bk, GemmConfig().block_n), 1):
            geo = Geometry.of(shape, GemmConfig(block_k=bk, split_k=split))
            if geo.kp <= MAX_K_PADDING * shape[0] and (bk, split) not in out:
                out.append((bk, split))
    return out


def speed_candidates(numerics: tuple[int, int], fmt: str = "bf16") -> list[GemmConfig]:
    """Speed settings of one format at fixed numerics. LH12 also varies its decode options (how
    escapes are looked up, how bytes are interleaved) and keeps 4 warps: 8 ran slower for it
    everywhere on the H200 (docs/results/kernels_h200.md)."""
    bk, split = numerics
    if fmt == "bf16":
        return [GemmConfig(block_n=bn, block_k=bk, split_k=split, num_warps=w, num_stages=s)
                for bn in BLOCK_N for w in NUM_WARPS for s in NUM_STAGES]
    return [GemmConfig(block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=s,
                       escape_lookup=lookup, decode=decode, one_dot=one)
            for one in (True, False) for decode in LH12_DECODES for lookup in LH12_LOOKUPS
            for bn in LH12_BLOCK_N for s in NUM_STAGES]


def wide_candidates(shape: Shape, base: GemmConfig, fmt: str = "bf16") -> list[GemmConfig]:
    """Speed settings for wide steps under `base`'s numerics and weight layout (`check_layout`),
    likeliest first: more warps (four row chunks of accumulators), then narrower tiles."""
    plain = dataclasses.replace(base, wide=None)
    out = []
    widths = (base.block_n,) + tuple(b for b in sorted(BLOCK_N) if b != base.block_n) if fmt == "bf16" \
        else (base.block_n,)
    decodes = (base.decode,) + tuple(d for d in LH12_DECODES if d != base.decode) if fmt == "lh12" \
        else (base.decode,)
    for decode in decodes:
        for bn in widths:
            for w in (8, 4):
                for st in (3, 2, 4):
                    cand = dataclasses.replace(plain, block_n=bn, num_warps=w, num_stages=st, decode=decode)
                    try:
                        check_layout(shape, dataclasses.replace(plain, wide=cand), fmt)
                    except ValueError:
                        continue
                    if cand != plain and cand not in out:
                        out.append(cand)
    return out


def default_tiles(shape: Shape, fmt: str = "bf16") -> GemmConfig:
    """What runs untuned: the kernels' shape-based default for the format (`default_config`:
    per-format speed settings, one numerics for both formats)."""
    from pallas_kernels.skinny_gemm import default_config
    return default_config(tuple(shape), fmt)


def with_numerics(cfg: GemmConfig, numerics: tuple[int, int]) -> GemmConfig:
    return dataclasses.replace(cfg, block_k=numerics[0], split_k=numerics[1])


# ----------------------------------------------------------------------------- cache

def cache_path(store_dir: str | Path, device: str) -> Path:
    return Path(store_dir) / "kernels" / f"{device}.json"


def _config_from(path: Path, key: str, fmt: str, fields) -> GemmConfig:
    try:
        cfg = GemmConfig(**fields)
        k, _, n = key.partition("x")
        check_layout((int(k), int(n)), cfg, fmt)
        return cfg
    except (TypeError, ValueError) as e:
        raise CorruptFileError(f"{path}: shapes.{key}.{fmt} is not a GemmConfig: {e}") from None


def read_cache(path: str | Path) -> dict[str, dict]:
    """{'KxN': entry} of a device's cache ({} when there is none). A damaged file, an entry that is
    no GemmConfig, or a pair whose numerics differ is refused with CorruptFileError naming the
    file: silently falling back could change an engine's numerics."""
    path = Path(path)
    if not path.exists():
        return {}
    payload = read_json_checked(path)
    if not isinstance(payload, dict) or payload.get("format_version") != CACHE_VERSION \
            or not isinstance(payload.get("shapes"), dict):
        raise CorruptFileError(f"{path}: not a kernel tile cache of format_version {CACHE_VERSION}")
    shapes = payload["shapes"]
    for key, entry in shapes.items():
        if not isinstance(entry, dict) or not all(f in entry for f in FORMATS):
            raise CorruptFileError(f"{path}: shapes.{key} lacks a config for each of {FORMATS}")
        pair = [_config_from(path, key, f, entry[f]) for f in FORMATS]
        if pair[0].numerics != pair[1].numerics:
            raise CorruptFileError(f"{path}: shapes.{key}: bf16 and lh12 configs have different "
                                   f"numerics {pair[0].numerics} vs {pair[1].numerics}")
    return shapes


def write_entries(path: str | Path, device: str, entries: dict[str, dict]) -> None:
    """Merge entries into the cache, atomically (a reader sees the old file or the new one)."""
    shapes = read_cache(path)  # a corrupt cache is refused, never overwritten blind
    shapes.update(entries)
    write_json_atomic(path, {"format_version": CACHE_VERSION, "device": device, "shapes": shapes})


def tuned_config(shape: Shape, fmt: str, device: str | None = None,
                 store_dir: str | Path = "memory_store") -> GemmConfig:
    """The cached config of one weight shape and format on a device (default: this one), or
    `default_tiles(shape, fmt)` when the cache has no entry: what the engine runs with
    kernel_tiles='tuned'."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (one of {FORMATS})")
    if device is None:
        from specjax.costmodel.hardware import current_device_name
        device = current_device_name()
    path = cache_path(store_dir, device)
    entry = read_cache(path).get(shape_key(tuple(shape)))
    return default_tiles(shape, fmt) if entry is None else GemmConfig(**entry[fmt])


def _plain(cfg: GemmConfig) -> GemmConfig:
    return dataclasses.replace(cfg, wide=None)


# ----------------------------------------------------------------------------- the tuner

@dataclasses.dataclass
class ShapeResult:
    shape: Shape
    baseline: dict[str, GemmConfig]  # fmt -> config before tuning
    baseline_s: dict[str, dict[int, float]]  # fmt -> T -> seconds
    best: dict[str, GemmConfig] | None = None  # a pair sharing numerics; None: not swept
    best_s: dict[str, dict[int, float]] | None = None
    tried: int = 0  # (format, config) candidates timed, the baseline included
    errors: list[str] = dataclasses.field(default_factory=list)
    cached: dict[str, GemmConfig] = dataclasses.field(default_factory=dict)  # the cache's entry
    wide_s: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # fmt -> base/wide s

    def floor_s(self, fmt: str, ceiling: float) -> float:
        bits = 16.0 if fmt == "bf16" else LH12_NOMINAL_BITS
        return 2 * self.shape[0] * self.shape[1] * bits / 16.0 / ceiling

    def gap(self, times: dict[str, dict[int, float]], ceiling: float) -> float:
        """1 - floor / time over both formats and every T: 0 at the ceiling, toward 1 far below."""
        floor = sum(self.floor_s(f, ceiling) * len(ts) for f, ts in times.items())
        total = sum(sum(ts.values()) for ts in times.values())
        return 1.0 - floor / total if total > 0 and math.isfinite(total) else 1.0

    def gbps(self, times: dict[str, dict[int, float]]) -> dict[str, dict[str, float]]:
        """bf16-equivalent GB/s (2 K N bytes / time) per format and T, LH12 included."""
        nbytes = 2 * self.shape[0] * self.shape[1]
        return {f: {str(t): nbytes / s / 1e9 for t, s in ts.items()} for f, ts in times.items()}


class KernelTuner:
    """Sweep tile configs per shape under a budget; `run()` -> results, cache written per shape."""

    def __init__(self, time_fn: TimeFn, device: str, store_dir: str | Path = "memory_store",
                 ceiling: float = DEFAULT_CEILING, budget_s: float = 300.0, tokens=TOKENS,
                 clock: Callable[[], float] = time.monotonic, progress: Callable[[str], None] = print):
        self.time_fn, self.device, self.ceiling = time_fn, device, ceiling
        self.path = cache_path(store_dir, device)
        self.budget_s, self.tokens, self.clock, self.progress = budget_s, tuple(tokens), clock, progress
        self._times: dict = {}  # (shape, fmt, config) -> {T: seconds}, inf where it failed
        self._times_at: dict = {}  # (shape, fmt, config, T) -> seconds (wide steps)

    def _measure(self, res: ShapeResult, fmt: str, cfg: GemmConfig) -> float:
        """Seconds summed over T of one (format, config); inf when it fails to build or run."""
        key = (res.shape, fmt, cfg)
        if key not in self._times:
            res.tried += 1
            try:
                self._times[key] = {t: float(self.time_fn(res.shape, fmt, cfg, t)) for t in self.tokens}
            except Exception as e:  # noqa: BLE001 - e.g. a tile that overflows shared memory
                res.errors.append(f"{fmt} {cfg}: {type(e).__name__}: {e}"[:300])
                self._times[key] = {t: math.inf for t in self.tokens}
        return sum(self._times[key].values())

    def _pair(self, shape: Shape, numerics) -> tuple[dict[str, GemmConfig], float] | None:
        """Best measured config per format with these numerics, and their summed seconds."""
        best = {}
        for (s, fmt, cfg), ts in self._times.items():
            total = sum(ts.values())
            if s == shape and cfg.numerics == numerics and math.isfinite(total):
                if fmt not in best or total < best[fmt][1]:
                    best[fmt] = (cfg, total)
        if len(best) < len(FORMATS):
            return None
        return {f: best[f][0] for f in FORMATS}, sum(best[f][1] for f in FORMATS)

    def _best_pair(self, shape: Shape) -> dict[str, GemmConfig] | None:
        pairs = [p for n in {c.numerics for (s, _, c) in self._times if s == shape}
                 if (p := self._pair(shape, n)) is not None]
        return min(pairs, key=lambda p: p[1])[0] if pairs else None

    def _sweep(self, res: ShapeResult, deadline: float):
        """Numerics first (each format's current speed settings), then speed per format for the
        best numerics; stops at the deadline after the candidate in flight."""
        base = res.baseline
        for numerics in numerics_candidates(res.shape):
            for fmt in FORMATS:
                if self.clock() >= deadline:
                    return
                self._measure(res, fmt, with_numerics(base[fmt], numerics))
        tried = set(numerics_candidates(res.shape)) | {base["bf16"].numerics}
        ranked = sorted((p[1], n) for n in tried if (p := self._pair(res.shape, n)) is not None)
        for _, numerics in ranked[:SPEED_NUMERICS]:
            cands = {fmt: speed_candidates(numerics, fmt) for fmt in FORMATS}
            for i in range(max(len(c) for c in cands.values())):  # the formats take turns
                for fmt in FORMATS:
                    if i >= len(cands[fmt]):
                        continue
                    if self.clock() >= deadline:
                        return
                    self._measure(res, fmt, cands[fmt][i])

    def run(self, shapes: list[Shape]) -> list[ShapeResult]:
        start = self.clock()
        end = start + self.budget_s
        cached = read_cache(self.path)
        results = []
        for shape in shapes:  # the baseline: what runs today, on every shape
            entry = cached.get(shape_key(shape))
            cached_cfg = {f: GemmConfig(**entry[f]) for f in FORMATS} if entry else {}
            current = {f: _plain(cached_cfg[f]) if entry else default_tiles(shape, f) for f in FORMATS}
            res = ShapeResult(shape, current, {})
            res.cached = cached_cfg
            if self.clock() >= end:
                self.progress(f"{shape_key(shape)}: budget spent before its baseline")
                continue
            for f in FORMATS:
                self._measure(res, f, current[f])
                res.baseline_s[f] = dict(self._times[shape, f, current[f]])
            results.append(res)
            self.progress(f"{shape_key(shape)}: {self._describe(res, res.baseline_s)} (current tiles)")
        results.sort(key=lambda r: -r.gap(r.baseline_s, self.ceiling))  # furthest from the ceiling first
        for i, res in enumerate(results):
            now = self.clock()
            if now >= end:
                self.progress(f"{shape_key(res.shape)}: budget spent, not swept")
                continue
            gaps = [max(r.gap(r.baseline_s, self.ceiling), 0.0) for r in results[i:]]
            share = gaps[0] / sum(gaps) if sum(gaps) > 0 else 1.0 / len(gaps)
            self._sweep(res, now + (end - now) * share)
            pair = self._best_pair(res.shape)
            if pair is None:  # not even the baseline ran: keep what the cache had
                continue
            res.best_s = {f: dict(self._times[res.shape, f, pair[f]]) for f in FORMATS}
            # the same settings as cached keep their wide ones (same numerics and layout)
            res.best = {f: res.cached[f] if f in res.cached and _plain(res.cached[f]) == pair[f] else pair[f]
                        for f in FORMATS}
            self._save(res)
            self.progress(f"{shape_key(res.shape)}: {self._describe(res, res.best_s)} after "
                          f"{res.tried} candidates; bf16 {pair['bf16']}, lh12 {pair['lh12']}")
        return results

    def run_wide(self, shapes: list[Shape]) -> list[ShapeResult]:
        """Wide-step settings for the cached pair of each shape (a shape without one is skipped:
        tune its pair first), shapes in order, each given an equal share of the remaining budget."""
        start = self.clock()
        end = start + self.budget_s
        cached = read_cache(self.path)
        results = []
        todo = [s for s in shapes if shape_key(s) in cached]
        for s in shapes:
            if shape_key(s) not in cached:
                self.progress(f"{shape_key(s)}: no tuned pair in {self.path}: wide step not tuned")
        for i, shape in enumerate(todo):
            entry = cached[shape_key(shape)]
            pair = {f: GemmConfig(**entry[f]) for f in FORMATS}
            res = ShapeResult(shape, pair, {}, cached=pair)
            deadline = self.clock() + (end - self.clock()) / (len(todo) - i)
            best = {}
            for j, fmt in enumerate(FORMATS):  # the formats share the shape's time equally
                fmt_deadline = self.clock() + (deadline - self.clock()) / (len(FORMATS) - j)
                base = _plain(pair[fmt])
                base_s = self._measure_at(res, fmt, base, WIDE_TOKENS)
                cands = [(base_s, base)]
                for cand in wide_candidates(shape, base, fmt):
                    if self.clock() >= fmt_deadline:
                        break
                    cands.append((self._measure_at(res, fmt, cand, WIDE_TOKENS), cand))
                top_s, top = min(cands, key=lambda c: c[0])
                res.wide_s[fmt] = {"base": base_s, "wide": top_s}
                keep = top != base and top_s < (1 - WIDE_MIN_GAIN) * base_s
                best[fmt] = dataclasses.replace(base, wide=top if keep else None)
            res.best = best
            self._save_wide(res, entry)
            results.append(res)
            gbps = {f: 2 * shape[0] * shape[1] / res.wide_s[f]["wide"] / 1e9 for f in FORMATS}
            self.progress(f"{shape_key(shape)}: T={WIDE_TOKENS} " + ", ".join(
                f"{f} {2 * shape[0] * shape[1] / res.wide_s[f]['base'] / 1e9:.0f} -> {gbps[f]:.0f} GB/s"
                f" ({'wide ' + str(best[f].wide) if best[f].wide else 'pair settings kept'})" for f in FORMATS))
        return results

    def _measure_at(self, res: ShapeResult, fmt: str, cfg: GemmConfig, tokens: int) -> float:
        """Seconds of one (format, config) at one T; inf when it fails."""
        key = (res.shape, fmt, cfg, tokens)
        if key not in self._times_at:
            res.tried += 1
            try:
                self._times_at[key] = float(self.time_fn(res.shape, fmt, cfg, tokens))
            except Exception as e:  # noqa: BLE001 - e.g. a tile that overflows shared memory
                res.errors.append(f"{fmt} {cfg} T={tokens}: {type(e).__name__}: {e}"[:300])
                self._times_at[key] = math.inf
        return self._times_at[key]

    def _save_wide(self, res: ShapeResult, entry: dict):
        nbytes = 2 * res.shape[0] * res.shape[1]
        new = dict(entry)
        new.update({f: dataclasses.asdict(res.best[f]) for f in FORMATS})
        new["gbps_wide"] = {f: {k: nbytes / v / 1e9 for k, v in res.wide_s[f].items() if math.isfinite(v)}
                            for f in FORMATS}
        new["wide_tokens"] = WIDE_TOKENS
        write_entries(self.path, self.device, {shape_key(res.shape): new})

    def _describe(self, res: ShapeResult, times) -> str:
        gbps = res.gbps(times)
        per = ", ".join(f"{f} " + "/".join(f"{v:.0f}" for v in gbps[f].values()) for f in gbps)
        return (f"GB/s at T={'/'.join(map(str, self.tokens))}: {per}; gap to "
                f"{self.ceiling / 1e9:.0f} GB/s {res.gap(times, self.ceiling):.0%}")

    def _save(self, res: ShapeResult):
        entry = {f: dataclasses.asdict(res.best[f]) for f in FORMATS}
        entry.update(gbps=res.gbps(res.best_s), measured_at=datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"), jax=jax.__version__)
        write_entries(self.path, self.device, {shape_key(res.shape): entry})


# ----------------------------------------------------------------------------- fake timer

class FakeTimer:
    """A deterministic stand-in for the GPU timer (tests and `tune-kernels --fake-timer` on
    machines without a GPU): bytes / (ceiling x a per-config efficiency in [0.4, 0.95] drawn from
    a checksum of the config). Its numbers mean nothing about any device."""

    def __init__(self, ceiling: float = DEFAULT_CEILING):
        self.ceiling = ceiling

    def __call__(self, shape: Shape, fmt: str, cfg: GemmConfig, tokens: int) -> float:
        bits = 16.0 if fmt == "bf16" else LH12_NOMINAL_BITS
        draw = zlib.crc32(repr((shape, fmt, dataclasses.astuple(cfg))).encode()) / 2 ** 32
        eff = 0.4 + 0.55 * draw
        return 2 * shape[0] * shape[1] * bits / 16.0 / (self.ceiling * eff) * (1 + 0.01 * tokens)
