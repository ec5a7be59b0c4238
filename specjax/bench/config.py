"""A bench config: one deployment's protocol (model, prompt sets, methods, batch sizes, repeats,
peers), read from YAML with errors that name the file and the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from specjax.bench.prompt_sets import PROMPT_SETS
from specjax.errors import ConfigError

# transformers_early_exit:LAYERS: its assisted generation drafting with its own first LAYERS layers
# (`assistant_early_exit`), the drafter our `layerskip:LAYERS` is
PEERS = ("transformers_ar", "transformers_prompt_lookup", "transformers_early_exit:LAYERS")


def _peer_ok(name) -> bool:
    if name in PEERS[:2]:
        return True
    head, _, layers = str(name).partition(":")
    return head == "transformers_early_exit" and layers.isdigit() and int(layers) >= 1
KERNELS = ("auto", "xla", "pallas", "interpret")  # as Decoder takes them


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method: a drafter spelling as `specjax generate --drafter` takes it, with k
    drafts a step and optionally a tree of `tree` nodes; or, with no drafter, an AR variant (other
    kernels or 12-bit weights) timed beside the reference AR and compared by its tokens."""
    name: str
    drafter: str | None = None
    k: int = 0
    tree: int | None = None
    weights: str = "bf16"  # "lh12": the 12-bit format (kernels run it; XLA reads it decoded)
    kernels: str | None = None  # None: the config's; "pallas": our GEMM kernels (12-bit needs them to pay)
    # the searched config: the best validated record of the memory store whose deployment has these
    # fields (and the bench's model as its target), e.g. (("hardware", "h200"), ("batch", 1))
    memory: tuple[tuple[str, str | int], ...] | None = None
    # a mechanism config spelled in the search registry's names (what a memory record keeps), run
    # as the search runs it: batching mechanisms go through the continuous-batching engine
    mechanisms: tuple[tuple[str, object], ...] | None = None


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    deployment: str
    model: str = "smollm2-135m"
    dtype: str = "float32"
    sets: tuple[tuple[str, int], ...] = (("humaneval", 4), ("sharegpt", 4), ("mmlu_cot", 4),
                                        ("gsm8k_cot", 4), ("pydoc", 4))
    max_new_tokens: int = 32
    repeats: int = 3
    batch_sizes: tuple[int, ...] = (1,)
    methods: tuple[Method, ...] = (Method("ngram-4", "ngram", 4),)
    peers: tuple[str, ...] = ()
    tolerance: float = 1e-3  # forcing: a target top-1/top-2 margin below this is a near tie
    kernels: str = "auto"
    batch1_prompts: int | None = None  # batch 1 uses the first N of each set (None: all of them)
    peer_repeats: int | None = None  # repeats of the transformers peers (None: repeats)
    # float32 matmuls: "highest" keeps them float32 on a GPU (JAX's default there may round the
    # inputs to TF32, whose noise is far above the forcing gate's near-tie tolerance)
    matmul_precision: str | None = None


MATMUL_PRECISIONS = ("default", "high", "highest")


def _fail(where: str, msg: str):
    raise ConfigError(f"{where}: {msg}")


def _int(where, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(where, f"expected an integer >= {low}, got {value!r}")
    return value


def load_bench_config(path: str) -> BenchConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: bench config not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        _fail(path, "expected a mapping at the top level")
    return bench_config_from_dict(raw, path)


def bench_config_from_dict(raw: dict, where: str = "bench config") -> BenchConfig:
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    for key in raw:
        if key not in known:
            _fail(f"{where}: {key}", f"unknown field; known: {', '.join(sorted(known))}")
    if "deployment" not in raw:
        _fail(where, "missing field deployment (a name for this config)")
    kw = dict(deployment=str(raw["deployment"]))
    for key in ("model", "dtype", "kernels"):
        if key in raw:
            kw[key] = str(raw[key])
    if raw.get("matmul_precision") is not None:
        if raw["matmul_precision"] not in MATMUL_PRECISIONS:
            _fail(f"{where}: matmul_precision",
                  f"expected one of {', '.join(MATMUL_PRECISIONS)}, got {raw['matmul_precision']!r}")
        kw["matmul_precision"] = raw["matmul_precision"]
    if kw.get("kernels", "auto") not in KERNELS:
        _fail(f"{where}: kernels", f"expected one of {', '.join(KERNELS)}, got {kw['kernels']!r}")
    if "sets" in raw:
        sets = raw["sets"]
        if not isinstance(sets, dict) or not sets:
            _fail(f"{where}: sets", "expected a mapping of prompt set name -> prompt count")
        for name, n in sets.items():
            if name not in PROMPT_SETS:
                _fail(f"{where}: sets.{name}", f"unknown prompt set; known: {', '.join(PROMPT_SETS)}")
            _int(f"{where}: sets.{name}", n)
        kw["sets"] = tuple(sets.items())
    for key in ("max_new_tokens", "repeats"):
        if key in raw:
            kw[key] = _int(f"{where}: {key}", raw[key])
    for key in ("batch1_prompts", "peer_repeats"):
        if raw.get(key) is not None:
            kw[key] = _int(f"{where}: {key}", raw[key])
    if "batch_sizes" in raw:
        bs = raw["batch_sizes"]
        if not isinstance(bs, list) or not bs:
            _fail(f"{where}: batch_sizes", "expected a list of integers >= 1")
        kw["batch_sizes"] = tuple(_int(f"{where}: batch_sizes[{i}]", b) for i, b in enumerate(bs))
    if "tolerance" in raw:
        if not isinstance(raw["tolerance"], (int, float)) or raw["tolerance"] < 0:
            _fail(f"{where}: tolerance", f"expected a number >= 0, got {raw['tolerance']!r}")
        kw["tolerance"] = float(raw["tolerance"])
    if "methods" in raw:
        kw["methods"] = tuple(_method(f"{where}: methods[{i}]", m) for i, m in enumerate(raw["methods"] or []))
    if "peers" in raw:
        peers = raw["peers"] or []
        for i, p in enumerate(peers):
            if not _peer_ok(p):
                _fail(f"{where}: peers[{i}]", f"unknown peer {p!r}; known: {', '.join(PEERS)}")
        kw["peers"] = tuple(peers)
    return BenchConfig(**kw)


def _method(where: str, m) -> Method:
    if not isinstance(m, dict) or "name" not in m:
        _fail(where, "expected a mapping with at least a name")
    extra = set(m) - {f.name for f in dataclasses.fields(Method)}
    if extra:
        _fail(where, f"unknown field(s) {', '.join(sorted(extra))}")
    if m.get("memory") is not None:
        return _memory_method(where, m)
    if m.get("mechanisms") is not None:
        return _mechanisms_method(where, m)
    drafter = m.get("drafter")
    k = m.get("k", 0 if drafter is None else None)
    if drafter is not None and k is None:
        _fail(where, "a method with a drafter needs k (drafts per step)")
    if drafter is not None:
        _int(f"{where}.k", k)
    tree = m.get("tree")
    if tree is not None:
        _int(f"{where}.tree", tree)
        if drafter is None:
            _fail(f"{where}.tree", "a tree needs a drafter")
    weights = m.get("weights", "bf16")
    if weights not in ("bf16", "lh12"):
        _fail(f"{where}.weights", f"expected bf16 or lh12, got {weights!r}")
    return Method(str(m["name"]), drafter, int(k or 0), tree, weights, _kernels(where, m))


def _kernels(where: str, m: dict) -> str | None:
    kernels = m.get("kernels")
    if kernels not in (None, *KERNELS):
        _fail(f"{where}.kernels", f"expected one of {', '.join(KERNELS)}, got {kernels!r}")
    return kernels


def _only_with(where: str, m: dict, field: str, takes: str) -> str | None:
    """A method spelled by `field` (memory, mechanisms) takes nothing else but its name and
    kernels -> its kernels."""
    mixed = sorted(set(m) - {"name", field, "kernels"})
    if mixed:
        _fail(where, f"a {field} method takes {takes}; drop {', '.join(mixed)}")
    return _kernels(where, m)


def _memory_method(where: str, m: dict) -> Method:
    fields = m["memory"]
    if not isinstance(fields, dict) or not fields:
        _fail(f"{where}.memory", "expected a mapping of deployment fields (hardware, batch, ...) to match")
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            _fail(f"{where}.memory.{key}", f"expected a string or an integer, got {value!r}")
    kernels = _only_with(where, m, "memory", "its mechanisms from the record")
    return Method(str(m["name"]), kernels=kernels, memory=tuple(sorted(fields.items())))


def _mechanisms_method(where: str, m: dict) -> Method:
    from specjax.search.registry import REGISTRY
    config = m["mechanisms"]
    if not isinstance(config, dict) or not config:
        _fail(f"{where}.mechanisms", "expected a mapping of registry parameters (drafter.kind, serving.packed, ...)")
    params = REGISTRY.params()
    for name, value in config.items():
        if name not in params:
            _fail(f"{where}.mechanisms.{name}", "not a parameter of the search registry (known: "
                  f"{', '.join(sorted(params))})")
        if not params[name].admits(value):
            allowed = (", ".join(map(str, params[name].values)) if params[name].values
                       else f"{params[name].kind} in [{params[name].low}, {params[name].high}]")
            _fail(f"{where}.mechanisms.{name}", f"{value!r} is not allowed (allowed: {allowed})")
    kernels = _only_with(where, m, "mechanisms", "its drafter and weights from the mapping")
    return Method(str(m["name"]), kernels=kernels, mechanisms=tuple(sorted(config.items())))
