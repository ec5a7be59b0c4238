"""Search specs: a YAML file declaring the deployment, the mechanism spaces, the budget and the
proposer. Documented in docs/search_spec.md. Every error names the file, the line and the key.

A config is a flat dict {param: value} holding only *active* parameters (a parameter whose `when:`
condition fails is absent, not null), so configs hash and deduplicate cleanly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from pathlib import Path

from specjax.errors import ConfigError
from specjax.search.expr import Expression
from specjax.search.registry import REGISTRY, Registry
from specjax.search.yaml_lines import LineDict, load_yaml

TOP_KEYS = {"version", "name", "deployment", "stock", "space", "constraints", "budget", "proposer",
            "gates", "evaluator", "output"}
DEPLOYMENT_KEYS = {"target", "dtype", "hardware", "batch", "prompts", "max_new_tokens", "sampling", "tp"}
PROMPT_SOURCES = ("humaneval", "file")
HARDWARE_KEYS = {"name", "bandwidth_GBps", "peak_tflops", "step_overhead_us"}
BUDGET_KEYS = {"rounds", "agents", "proposals_per_agent", "measure_per_round", "runs", "wall_clock_s"}
PROPOSERS = ("offline", "gemini", "replay")
PROPOSER_KEYS = {"kind", "seed", "model", "replay_file"}
GATES_KEYS = {"forcing_tolerance", "floor_tolerance"}
EVALUATOR_KINDS = ("inprocess", "subprocess", "ray")
EVALUATOR_KEYS = {"kind", "workers", "timeout_s", "startup_timeout_s", "ray_address"}
PARAM_KEYS = {"type", "values", "range", "step", "log", "when"}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # categorical | int | float
    values: tuple = ()  # categorical values, or the explicit grid of an int/float parameter
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    when: tuple[tuple[str, tuple], ...] = ()  # active iff every (parent, allowed values) holds
    line: int = 0

    def grid(self, max_points: int = 64) -> tuple:
        """The values a proposer may choose from (numeric ranges discretized by step / log)."""
        if self.values:
            return self.values
        if self.kind == "int":
            step = int(self.step or 1)
            pts = list(range(int(self.low), int(self.high) + 1, step))
            if self.log:
                pts = sorted({int(round(math.exp(x))) for x in _linspace(math.log(self.low), math.log(self.high),
                                                                          min(len(pts), max_points))})
            return tuple(pts[:: max(1, len(pts) // max_points)] if len(pts) > max_points else pts)
        if self.step:
            n = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
            return tuple(self.low + i * self.step for i in range(min(n, max_points)))
        if self.log:
            return tuple(math.exp(x) for x in _linspace(math.log(self.low), math.log(self.high), 16))
        return tuple(_linspace(self.low, self.high, 16))

    def active(self, config: dict) -> bool:
        return all(config.get(parent) in allowed for parent, allowed in self.when)


def _linspace(a, b, n):
    return [a + (b - a) * i / max(n - 1, 1) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_GBps: float | None = None  # None: take the named device's table or calibration
    peak_tflops: float | None = None
    step_overhead_us: float | None = None


@dataclasses.dataclass(frozen=True)
class Deployment:
    target: str
    dtype: str = "float32"
    hardware: Hardware = Hardware("cpu")
    batch: int = 1
    prompt_source: str = "humaneval"
    prompt_n: int = 4
    prompt_offset: int = 0
    prompt_file: str | None = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    tp: int = 1  # tensor-parallel devices the target is split over (docs/design/tensor_parallel.md)

    def fingerprint(self) -> dict:
        return {**({"tp": self.tp} if self.tp > 1 else {}), "target": self.target, "hardware": self.hardware.name, "batch": self.batch,
                "prompts": f"{self.prompt_source}:{self.prompt_n}@{self.prompt_offset}",
                "max_new_tokens": self.max_new_tokens,
                "sampling": "greedy" if self.temperature == 0 else f"t{self.temperature}/p{self.top_p}",
                "weight_format": self.dtype}


@dataclasses.dataclass(frozen=True)
class Budget:
    rounds: int = 3
    agents: int = 2
    proposals_per_agent: int = 16
    measure_per_round: int = 3
    runs: int = 3
    wall_clock_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class EvaluatorSpec:
    """Where candidates are measured: in this process, one subprocess per GPU, or Ray actors (one GPU
    each). Out-of-process evaluators enforce `timeout_s` per candidate: a hung one is killed and failed."""
    kind: str = "inprocess"
    workers: int = 0  # 0: one per visible GPU (one on a CPU-only machine)
    timeout_s: float = 900.0
    startup_timeout_s: float = 900.0  # loading the target and the AR references in a fresh worker
    ray_address: str | None = None  # None: start a local Ray instance


@dataclasses.dataclass(frozen=True)
class SearchSpec:
    path: str
    name: str
    deployment: Deployment
    stock: dict
    space: dict[str, Param]
    constraints: tuple[Expression, ...]
    budget: Budget
    proposer: str = "offline"
    proposer_options: dict = dataclasses.field(default_factory=dict)
    forcing_tolerance: float = 1e-3
    floor_tolerance: float = 0.1
    output: str = "runs/search"
    evaluator: EvaluatorSpec = EvaluatorSpec()

    def canonical(self, config: dict) -> dict:
        """Keep only active parameters; parents are declared before children, so one pass does."""
        out: dict = {}
        for name, p in self.space.items():
            if name in config and p.active(out):
                out[name] = config[name]
        return out

    def violations(self, config: dict) -> list[str]:
        errs = []
        for name, p in self.space.items():
            if p.active(config) and name not in config:
                errs.append(f"{name} is active but has no value")
            elif not p.active(config) and name in config:
                errs.append(f"{name} is set but inactive")
            elif name in config and p.values and config[name] not in p.values:
                errs.append(f"{name}={config[name]!r} is not among {list(p.values)}")
            elif name in config and p.low is not None and not p.low <= config[name] <= p.high:
                errs.append(f"{name}={config[name]!r} is outside [{p.low}, {p.high}]")
        for c in self.constraints:
            if not c.holds(config):
                errs.append(f"constraint {c.text!r} fails")
        return errs

    def is_valid(self, config: dict) -> bool:
        return not self.violations(config)

    def random_config(self, rng: random.Random) -> dict:
        config: dict = {}
        for name, p in self.space.items():  # parents are declared before children
            if p.active(config):
                config[name] = rng.choice(p.grid())
        return config


# ----------------------------------------------------------------------------- parsing


class _Ctx:
    def __init__(self, path: str):
        self.path = path

    def err(self, line: int, key: str, msg: str):
        raise ConfigError(f"{self.path}:{line}: {key}: {msg}")

    def mapping(self, d, key: str, line: int, allowed: set[str]) -> LineDict:
        if not isinstance(d, dict):
            self.err(line, key, f"must be a mapping, got {type(d).__name__}")
        for k in d:
            if k not in allowed:
                self.err(d.line_of(k), f"{key}.{k}" if key else k,
                         f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return d

    def typed(self, d: LineDict, key: str, types, prefix: str, default=None, required=False):
        if key not in d:
            if required:
                self.err(d.line, f"{prefix}{key}", "required key is missing")
            return default
        v = d[key]
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _as_tuple(types))
        if not ok:
            names = "/".join(t.__name__ for t in _as_tuple(types))
            self.err(d.line_of(key), f"{prefix}{key}", f"must be {names}, got {type(v).__name__} {v!r}")
        return v

    def positive(self, d, key, types, prefix, default, minimum=1):
        v = self.typed(d, key, types, prefix, default)
        if v < minimum:
            self.err(d.line_of(key), f"{prefix}{key}", f"must be >= {minimum}, got {v}")
        return v


def _as_tuple(t):
    return t if isinstance(t, tuple) else (t,)


def load_spec(path: str, registry: Registry = REGISTRY) -> SearchSpec:
    raw = load_yaml(path)
    ctx = _Ctx(str(path))
    ctx.mapping(raw, "", raw.line, TOP_KEYS)
    version = ctx.typed(raw, "version", int, "", 1)
    if version != 1:
        ctx.err(raw.line_of("version"), "version", f"unsupported spec version {version} (supported: 1)")
    name = ctx.typed(raw, "name", str, "", Path(path).stem)
    deployment = _deployment(ctx, raw)
    space = _space(ctx, raw, registry)
    _check_weight_formats(ctx, deployment, space)
    constraints = _constraints(ctx, raw, space)
    stock = _stock(ctx, raw, space, registry)
    budget = _budget(ctx, raw)
    kind, options = _proposer(ctx, raw)
    gates = ctx.mapping(raw.get("gates", LineDict()), "gates", raw.line_of("gates"), GATES_KEYS)
    forcing_tol = float(ctx.typed(gates, "forcing_tolerance", (int, float), "gates.", 1e-3))
    floor_tol = float(ctx.typed(gates, "floor_tolerance", (int, float), "gates.", 0.1))
    output = ctx.typed(raw, "output", str, "", f"runs/{name}")
    evaluator = _evaluator(ctx, raw)
    spec = SearchSpec(evaluator=evaluator, path=str(path), name=name, deployment=deployment, stock=stock, space=space,
                      constraints=tuple(constraints), budget=budget, proposer=kind, proposer_options=options,
                      forcing_tolerance=forcing_tol, floor_tolerance=floor_tol, output=output)
    _check_satisfiable(ctx, raw, spec)
    problems = spec.violations(spec.canonical(stock))
    if problems:
        ctx.err(raw.line_of("stock"), "stock", "; ".join(problems))
    return spec


def _deployment(ctx: _Ctx, raw: LineDict) -> Deployment:
    if "deployment" not in raw:
        ctx.err(raw.line, "deployment", "required key is missing")
    d = ctx.mapping(raw["deployment"], "deployment", raw.line_of("deployment"), DEPLOYMENT_KEYS)
    p = "deployment."
    target = ctx.typed(d, "target", str, p, required=True)
    dtype = ctx.typed(d, "dtype", str, p, "float32")
    if dtype not in ("float32", "bfloat16"):
        ctx.err(d.line_of("dtype"), p + "dtype", f"must be float32 or bfloat16, got {dtype!r}")
    hw_raw = d.get("hardware", "cpu")
    if isinstance(hw_raw, str):
        hardware = Hardware(hw_raw)
    else:
        h = ctx.mapping(hw_raw, p + "hardware", d.line_of("hardware"), HARDWARE_KEYS)
        hardware = Hardware(
            name=ctx.typed(h, "name", str, p + "hardware.", required=True),
            bandwidth_GBps=ctx.typed(h, "bandwidth_GBps", (int, float), p + "hardware."),
            peak_tflops=ctx.typed(h, "peak_tflops", (int, float), p + "hardware."),
            step_overhead_us=ctx.typed(h, "step_overhead_us", (int, float), p + "hardware."))
        for key in ("bandwidth_GBps", "peak_tflops"):
            v = getattr(hardware, key)
            if v is not None and v <= 0:
                ctx.err(h.line_of(key), p + "hardware." + key, f"must be > 0, got {v}")
    batch = ctx.positive(d, "batch", int, p, 1)
    prompts = ctx.mapping(d.get("prompts", LineDict()), p + "prompts", d.line_of("prompts"),
                          {"source", "n", "offset", "path"})
    source = ctx.typed(prompts, "source", str, p + "prompts.", "humaneval")
    if source not in PROMPT_SOURCES:
        ctx.err(prompts.line_of("source"), p + "prompts.source",
                f"unknown prompt source {source!r} (known: {', '.join(PROMPT_SOURCES)})")
    prompt_file = ctx.typed(prompts, "path", str, p + "prompts.", None)
    if source == "file" and prompt_file is None:
        ctx.err(prompts.line, p + "prompts.path", "required when source is file")
    sampling = ctx.mapping(d.get("sampling", LineDict()), p + "sampling", d.line_of("sampling"),
                           {"temperature", "top_p"})
    temperature = float(ctx.typed(sampling, "temperature", (int, float), p + "sampling.", 0.0))
    if temperature != 0:
        ctx.err(sampling.line_of("temperature"), p + "sampling.temperature",
                "the search gates every candidate by greedy token forcing; only temperature 0 is supported")
    return Deployment(
        target=target, dtype=dtype, hardware=hardware, batch=batch, prompt_source=source,
        prompt_n=ctx.positive(prompts, "n", int, p + "prompts.", 4),
        prompt_offset=ctx.positive(prompts, "offset", int, p + "prompts.", 0, minimum=0),
        prompt_file=prompt_file,
        max_new_tokens=ctx.positive(d, "max_new_tokens", int, p, 64), tp=ctx.positive(d, "tp", int, p, 1),
        temperature=temperature, top_p=float(ctx.typed(sampling, "top_p", (int, float), p + "sampling.", 1.0)))


def _space(ctx: _Ctx, raw: LineDict, registry: Registry) -> dict[str, Param]:
    if "space" not in raw:
        ctx.err(raw.line, "space", "required key is missing")
    s = raw["space"]
    if not isinstance(s, dict) or not s:
        ctx.err(raw.line_of("space"), "space", "must be a non-empty mapping of parameter -> definition")
    known = registry.params()
    space: dict[str, Param] = {}
    for name, d in s.items():
        line = s.line_of(name)
        key = f"space.{name}"
        if name not in known:
            ctx.err(line, key, f"unknown mechanism parameter (registered: {', '.join(sorted(known))})")
        d = ctx.mapping(d, key, line, PARAM_KEYS)
        kind = ctx.typed(d, "type", str, key + ".", required=True)
        if kind not in ("categorical", "int", "float"):
            ctx.err(d.line_of("type"), key + ".type", f"must be categorical, int or float, got {kind!r}")
        reg = known[name]
        if (kind == "categorical") != (reg.kind == "categorical") or (reg.kind == "int" and kind == "float"):
            ctx.err(d.line_of("type"), key + ".type", f"this parameter is {reg.kind}, not {kind}")
        values = d.get("values")
        rng = d.get("range")
        if values is not None:
            if not isinstance(values, list) or not values:
                ctx.err(d.line_of("values"), key + ".values", "must be a non-empty list")
            for v in values:
                if not reg.admits(v):
                    allowed = list(reg.values) if reg.values else f"{reg.kind} in [{reg.low}, {reg.high}]"
                    ctx.err(d.line_of("values"), key + ".values", f"value {v!r} is not allowed ({allowed})")
            if len(set(map(repr, values))) != len(values):
                ctx.err(d.line_of("values"), key + ".values", "values repeat")
        elif kind == "categorical":
            ctx.err(d.line, key + ".values", "a categorical parameter needs values")
        if rng is not None:
            if values is not None:
                ctx.err(d.line_of("range"), key, "give values or range, not both")
            if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, (int, float)) for x in rng)):
                ctx.err(d.line_of("range"), key + ".range", "must be [low, high]")
            if rng[0] > rng[1]:
                ctx.err(d.line_of("range"), key + ".range", f"is empty: low {rng[0]} > high {rng[1]}")
            if kind == "int" and not all(isinstance(x, int) and not isinstance(x, bool) for x in rng):
                ctx.err(d.line_of("range"), key + ".range", "an int range needs integer bounds")
            for x in rng:
                if not reg.admits(x):
                    ctx.err(d.line_of("range"), key + ".range", f"bound {x} is outside [{reg.low}, {reg.high}]")
        elif values is None:
            ctx.err(d.line, key, "needs values or range")
        step = ctx.typed(d, "step", (int, float), key + ".", None)
        if step is not None and step <= 0:
            ctx.err(d.line_of("step"), key + ".step", f"must be > 0, got {step}")
        log = ctx.typed(d, "log", bool, key + ".", False)
        if log and rng is not None and rng[0] <= 0:
            ctx.err(d.line_of("log"), key + ".log", "a log range needs low > 0")
        when = []
        w = d.get("when")
        if w is not None:
            w = ctx.mapping(w, key + ".when", d.line_of("when"), set(space))  # parents come first
            for parent, allowed in w.items():
                allowed = allowed if isinstance(allowed, list) else [allowed]
                for a in allowed:
                    if space[parent].values and a not in space[parent].values:
                        ctx.err(w.line_of(parent), f"{key}.when.{parent}",
                                f"{a!r} is not a value of {parent} ({list(space[parent].values)})")
                when.append((parent, tuple(allowed)))
        space[name] = Param(name=name, kind=kind, values=tuple(values or ()),
                            low=None if rng is None else rng[0], high=None if rng is None else rng[1],
                            step=step, log=log, when=tuple(when), line=line)
    return space


def _check_weight_formats(ctx: _Ctx, deployment: Deployment, space: dict[str, Param]):
    """LH12 stores bf16 patterns exactly; over a float32 target it would round the weights, and its
    tokens would differ from the target's."""
    if deployment.dtype == "bfloat16":
        return
    for name, p in space.items():
        if name.startswith("weights.") and "lh12" in p.values:
            ctx.err(p.line, f"space.{name}", f"lh12 is lossless over bf16 weights only; it needs "
                    f"deployment.dtype: bfloat16 (this spec has {deployment.dtype})")


def _constraints(ctx: _Ctx, raw: LineDict, space) -> list[Expression]:
    c = raw.get("constraints", [])
    if not isinstance(c, list):
        ctx.err(raw.line_of("constraints"), "constraints", "must be a list of expressions")
    out = []
    for i, text in enumerate(c):
        where = f"{ctx.path}:{raw.line_of('constraints') + i + 1}: constraints[{i}]"
        if not isinstance(text, str):
            raise ConfigError(f"{where}: must be a string expression, got {type(text).__name__}")
        out.append(Expression(text, set(space), where))
    return out


def _stock(ctx: _Ctx, raw: LineDict, space, registry: Registry) -> dict:
    s = raw.get("stock", LineDict())
    ctx.mapping(s, "stock", raw.line_of("stock"), set(space))
    return dict(s)


def _budget(ctx: _Ctx, raw: LineDict) -> Budget:
    b = ctx.mapping(raw.get("budget", LineDict()), "budget", raw.line_of("budget"), BUDGET_KEYS)
    d = Budget()
    return Budget(rounds=ctx.positive(b, "rounds", int, "budget.", d.rounds),
                  agents=ctx.positive(b, "agents", int, "budget.", d.agents),
                  proposals_per_agent=ctx.positive(b, "proposals_per_agent", int, "budget.", d.proposals_per_agent),
                  measure_per_round=ctx.positive(b, "measure_per_round", int, "budget.", d.measure_per_round),
                  runs=ctx.positive(b, "runs", int, "budget.", d.runs),
                  wall_clock_s=float(ctx.positive(b, "wall_clock_s", (int, float), "budget.", d.wall_clock_s)))


def _proposer(ctx: _Ctx, raw: LineDict):
    p = raw.get("proposer", LineDict())
    if isinstance(p, str):
        p = LineDict({"kind": p})
        p.line, p.key_lines = raw.line_of("proposer"), {}
    p = ctx.mapping(p, "proposer", raw.line_of("proposer"), PROPOSER_KEYS)
    kind = ctx.typed(p, "kind", str, "proposer.", "offline")
    if kind not in PROPOSERS:
        ctx.err(p.line_of("kind"), "proposer.kind", f"unknown proposer {kind!r} (known: {', '.join(PROPOSERS)})")
    return kind, {k: v for k, v in p.items() if k != "kind"}


def _evaluator(ctx: _Ctx, raw: LineDict) -> EvaluatorSpec:
    e = raw.get("evaluator", LineDict())
    if isinstance(e, str):
        e = LineDict({"kind": e})
        e.line, e.key_lines = raw.line_of("evaluator"), {}
    e = ctx.mapping(e, "evaluator", raw.line_of("evaluator"), EVALUATOR_KEYS)
    d = EvaluatorSpec()
    kind = ctx.typed(e, "kind", str, "evaluator.", d.kind)
    if kind not in EVALUATOR_KINDS:
        ctx.err(e.line_of("kind"), "evaluator.kind",
                f"unknown evaluator {kind!r} (known: {', '.join(EVALUATOR_KINDS)})")
    workers = ctx.typed(e, "workers", int, "evaluator.", 0)
    if workers < 0:
        ctx.err(e.line_of("workers"), "evaluator.workers", f"must be >= 0 (0: one per GPU), got {workers}")
    address = ctx.typed(e, "ray_address", str, "evaluator.", None)
    if address is not None and kind != "ray":
        ctx.err(e.line_of("ray_address"), "evaluator.ray_address", "only applies to evaluator.kind: ray")
    return EvaluatorSpec(
        kind=kind, workers=workers,
        timeout_s=float(ctx.positive(e, "timeout_s", (int, float), "evaluator.", d.timeout_s)),
        startup_timeout_s=float(ctx.positive(e, "startup_timeout_s", (int, float), "evaluator.",
                                             d.startup_timeout_s)),
        ray_address=address)


def _check_satisfiable(ctx: _Ctx, raw: LineDict, spec: SearchSpec, tries: int = 2000):
    """Enumerate small spaces, sample large ones: some config must satisfy every constraint."""
    grids = [p.grid() for p in spec.space.values()]
    if math.prod(len(g) + 1 for g in grids) <= 20000:
        names = list(spec.space)
        for combo in itertools.product(*grids):
            if spec.is_valid(spec.canonical(dict(zip(names, combo)))):
                return
    else:
        rng = random.Random(0)
        for _ in range(tries):
            if spec.is_valid(spec.random_config(rng)):
                return
    line = raw.line_of("constraints") if "constraints" in raw else raw.line_of("space")
    ctx.err(line, "constraints", "no configuration of the space satisfies every constraint")
