"""The mechanism registry: every engine mechanism the search can change, in one place.

A mechanism registers its parameters (name, type, allowed values, stock default), the cost-model
component it changes, and two functions: `features` (config -> numbers the vectorized cost model reads)
and `apply` (config -> keyword changes to the engine build). Adding a mechanism is one registration here
plus its terms in costmodel/model.py; specs, proposers and the loop pick it up from the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

COMPONENTS = ("verify", "draft", "commit", "host")  # cost-model components, in report order


@dataclasses.dataclass(frozen=True)
class ParamDef:
    name: str
    kind: str  # categorical | int | float
    values: tuple = ()  # allowed values (categorical), empty for numeric
    low: float | None = None
    high: float | None = None
    default: Any = None
    doc: str = ""
    components: tuple[str, ...] = ()  # cost components this parameter moves (for directions)

    def admits(self, value) -> bool:
        if self.kind == "categorical":
            return value in self.values
        if self.kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            return False
        if self.kind == "float" and not isinstance(value, (int, float)):
            return False
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)


@dataclasses.dataclass(frozen=True)
class Mechanism:
    name: str
    params: tuple[ParamDef, ...]
    component: str  # which cost component it changes (directions are chosen per component)
    features: Callable[[dict], dict[str, float]]
    apply: Callable[[dict], dict[str, Any]]
    doc: str = ""


class Registry:
    def __init__(self):
        self._mechanisms: dict[str, Mechanism] = {}

    def register(self, mechanism: Mechanism) -> Mechanism:
        if mechanism.name in self._mechanisms:
            raise ValueError(f"mechanism {mechanism.name!r} registered twice")
        self._mechanisms[mechanism.name] = mechanism
        return mechanism

    @property
    def mechanisms(self) -> dict[str, Mechanism]:
        return dict(self._mechanisms)

    def params(self) -> dict[str, ParamDef]:
        return {p.name: p for m in self._mechanisms.values() for p in m.params}

    def params_for(self, component: str) -> list[str]:
        """Parameters that move a cost component: what an agent given that direction may mutate."""
        return [p.name for m in self._mechanisms.values() for p in m.params
                if component in (p.components or (m.component,))]

    def stock(self) -> dict:
        return {name: p.default for name, p in self.params().items() if p.default is not None}

    def features(self, config: dict) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self._mechanisms.values():
            out.update(m.features(config))
        return out

    def apply(self, config: dict) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in self._mechanisms.values():
            out.update(m.apply(config))
        return out


REGISTRY = Registry()

# ----------------------------------------------------------------------------- drafter

# block: DFlash-style block drafter (trained checkpoint for the target, or untrained);
# replay: acceptance replay (a real block-drafter network of drafter.block_layers layers whose
# drafts are the target's own continuation corrupted per a recorded profile; labeled as such)
DRAFTER_KINDS = ("none", "ngram", "layerskip", "block", "replay")
BLOCK_SOURCES = ("trained", "random")
# Recorded acceptance profiles shipped with the trained drafters (specjax/drafters/trained/)
REPLAY_PROFILES = ("smollm2-135m-block8", "smollm2-135m-block16")


def _drafter_spelling(config: dict) -> str | None:
    kind = config.get("drafter.kind", "none")
    if kind == "none":
        return None
    if kind == "ngram":
        return f"ngram:{config.get('drafter.ngram_max_n', 3)}"
    layers = config.get("drafter.block_layers", 1)
    if kind == "block":
        if config.get("drafter.block", "trained") == "trained":
            return f"block:trained:{layers}"
        return f"block:random:{layers}"
    if kind == "replay":
        return f"replay:{config.get('drafter.replay_profile', REPLAY_PROFILES[0])}:{layers}"
    return f"layerskip:{config['drafter.layers']}"


def _draft_layers(config: dict) -> float:
    kind = config.get("drafter.kind", "none")
    if kind in ("block", "replay"):
        return float(config.get("drafter.block_layers", 1))
    return float(config.get("drafter.layers", 0))


PILOT_K = 8  # draft length of the acceptance pilots


def pilot_k(config: dict) -> int:
    """k of a variant's acceptance pilot: PILOT_K, or the config's own k where the drafter fixes it
    (a trained block drafter proposes exactly its block size - 1)."""
    if config.get("drafter.kind") == "block" and config.get("drafter.block", "trained") == "trained":
        return int(config.get("drafter.k", PILOT_K))
    return PILOT_K


def drafter_variant(config: dict) -> str:
    """What determines per-position acceptance (k does not, for greedy chains): kind + its size,
    and the tree's node budget and builder when it verifies trees (static trees keep the plain
    `+treeN` spelling of earlier profiles)."""
    nodes = tree_nodes(config)
    if not nodes:
        return _drafter_spelling(config) or "none"
    builder = tree_builder(config)
    return f"{_drafter_spelling(config)}+tree{nodes}" + ("" if builder == "static" else f":{builder}")


# drafters with per-position draft distributions (block_logits, propose_logits); acceptance replay
# replays recorded chain acceptance, which says nothing about trees
TREE_DRAFTERS = ("ngram", "layerskip", "block")
TREE_BUILDERS = ("static", "best_first", "topk")  # specjax/trees/builders.py


def tree_nodes(config: dict) -> int:
    """Drafted nodes of the verified tree; 0: a chain."""
    return int(config.get("tree.nodes", 0)) if config.get("drafter.kind") in TREE_DRAFTERS else 0


def tree_builder(config: dict) -> str:
    return config.get("tree.builder", "static")


REGISTRY.register(Mechanism(
    name="drafter",
    params=(
        ParamDef("drafter.kind", "categorical", DRAFTER_KINDS, default="none",
                 doc="none (plain AR), ngram prompt lookup, layerskip self-drafting, a block drafter, "
                     "or acceptance replay (benchmarks of targets without a trained drafter)",
                 components=("draft", "verify", "commit")),
        ParamDef("drafter.k", "int", low=1, high=32, doc="draft tokens per verify step",
                 components=("draft", "verify", "commit")),
        ParamDef("drafter.ngram_max_n", "int", low=1, high=8, doc="longest n-gram matched",
                 components=("draft",)),
        ParamDef("drafter.layers", "int", low=1, high=1024, doc="target layers the layer-skip drafter keeps",
                 components=("draft",)),
        ParamDef("drafter.block", "categorical", BLOCK_SOURCES,
                 doc="block drafter weights: the trained checkpoint for this target at block size k + 1 "
                     "(specjax/drafters/trained/), or untrained",
                 components=("draft", "verify", "commit")),
        ParamDef("drafter.block_layers", "int", low=1, high=16,
                 doc="layers of the block drafter (a trained one must have this many) or of the replay "
                     "drafter's network", components=("draft",)),
        ParamDef("drafter.replay_profile", "categorical", REPLAY_PROFILES,
                 doc="recorded acceptance profile the replay drafter borrows", components=("verify", "commit")),
    ),
    component="draft",
    features=lambda c: {
        "k": float(c.get("drafter.k", 0) if c.get("drafter.kind", "none") != "none" else 0),
        "draft_kind": float(DRAFTER_KINDS.index(c.get("drafter.kind", "none"))),
        "draft_layers": _draft_layers(c),
    },
    apply=lambda c: {"drafter": _drafter_spelling(c),
                     "k": int(c.get("drafter.k", 0)) if c.get("drafter.kind", "none") != "none" else 0},
    doc="which proposer drafts, and how many tokens per step",
))

# ----------------------------------------------------------------------------- trees


def _tree_spec(config: dict):
    """The engine's `tree`: a TreeSpec of tree.nodes drafted nodes at most k deep, or None."""
    nodes = tree_nodes(config)
    if not nodes:
        return None
    from specjax.trees.builders import TreeSpec
    return TreeSpec.budget(tree_builder(config), nodes, int(config.get("drafter.k", PILOT_K)))


REGISTRY.register(Mechanism(
    name="tree",
    params=(ParamDef("tree.nodes", "int", low=0, high=64, default=0,
                     doc="verify a tree of this many drafted nodes instead of a chain; 0: a chain. "
                         "Block, layer-skip and n-gram drafters",
                     components=("verify", "commit", "draft")),  # layer-skip trees re-feed k + 1 tokens
            ParamDef("tree.builder", "categorical", TREE_BUILDERS, default="static",
                     doc="how the tree spends its nodes: static (the top-1 chain plus alternatives top "
                         "down, TreeShape.for_budget), best_first (the likeliest paths, per row and step), "
                         "topk (the drafter's chain plus its likeliest alternatives)",
                     components=("verify",))),
    component="verify",
    features=lambda c: {"tree_nodes": float(tree_nodes(c))},
    apply=lambda c: {"tree": _tree_spec(c)},
    doc="tree verification: one target forward over the tree's nodes, the longest agreeing path kept",
))

# ----------------------------------------------------------------------------- weights

WEIGHT_GROUPS = ("attn", "mlp", "head")  # attn: w_qkv, w_o; mlp: w_gate_up, w_down; head: lm_head
WEIGHT_FORMATS = ("bf16", "lh12")
# Bits per weight of LH12 when the target's own tensors are not at hand: the median over SmolLM2's
# matrices (12.12; specjax/weights/lh12.py takes 12.03-12.3 by shape and escapes). The search
# replaces it with the target's per-group figure (Plan.lh12_bits) when it measured one.
LH12_NOMINAL_BITS = 12.12


def _weights_format(config: dict) -> dict[str, str]:
    return {g: config.get(f"weights.{g}", "bf16") for g in WEIGHT_GROUPS}


def _weights_features(config: dict) -> dict[str, float]:
    out = {}
    for g, fmt in _weights_format(config).items():
        lh12 = fmt == "lh12"
        out[f"weights_{g}_lh12"] = float(lh12)  # selects DeviceModel.lh12_efficiency for the group
        out[f"weights_{g}_bytes"] = LH12_NOMINAL_BITS / 16.0 if lh12 else 1.0  # of the bf16 bytes
    return out


REGISTRY.register(Mechanism(
    name="weights",
    params=tuple(
        ParamDef(f"weights.{g}", "categorical", WEIGHT_FORMATS, default="bf16",
                 doc=f"storage of the {g} matrices: bf16, or LH12 lossless 12-bit (same outputs, "
                     "about 3/4 of the bytes)",
                 components=("verify", "draft"))  # layer-skip drafts stream the same weights
        for g in WEIGHT_GROUPS),
    component="verify",
    features=_weights_features,
    apply=lambda c: {"weights_format": _weights_format(c)},
    doc="per tensor group, bf16 or lossless 12-bit weights read by the GPU skinny GEMMs",
))

# ----------------------------------------------------------------------------- kernel tiles

KERNEL_TILES = ("default", "tuned")

KERNEL_BACKENDS = ("xla", "pallas")


def kernels_on_pallas(config: dict) -> bool:
    """Whether a config runs the target's GEMMs on our Pallas skinny GEMMs: asked for outright, or
    implied by 12-bit weights or tuned tiles (only the kernels read those)."""
    return (config.get("kernels.backend", "xla") == "pallas"
            or config.get("kernels.tiles", "default") != "default"
            or any(fmt != "bf16" for fmt in _weights_format(config).values()))


def _kernels_backend(config: dict) -> str:
    """The engine's `kernels` argument: "pallas" on a GPU when the config needs the kernels; else
    XLA, also on a CPU, where the kernels' interpret mode is for tests and gives the same numbers
    (so a CPU search of this knob measures XLA under the cost model's Pallas price)."""
    if not kernels_on_pallas(config):
        return "xla"
    import jax
    return "pallas" if jax.devices()[0].platform == "gpu" else "xla"


REGISTRY.register(Mechanism(
    name="kernels",
    params=(ParamDef("kernels.tiles", "categorical", KERNEL_TILES, default="default",
                     doc="skinny GEMM tiles: GemmConfig() or the per-device tuned ones "
                         "(specjax tune-kernels, memory_store/kernels/)",
                     components=("verify", "draft")),
            ParamDef("kernels.backend", "categorical", KERNEL_BACKENDS, default="xla",
                     doc="the target's GEMMs: XLA's, or our Pallas skinny GEMMs (on a GPU their verify "
                         "steps round exactly as AR steps do; 12-bit weights and tuned tiles need them)",
                     components=("verify", "draft"))),
    component="verify",
    features=lambda c: {"kernels_tuned": float(c.get("kernels.tiles", "default") == "tuned"),
                        "kernels_pallas": float(kernels_on_pallas(c))},
    apply=lambda c: {"kernel_tiles": c.get("kernels.tiles", "default"), "kernels": _kernels_backend(c)},
    doc="which GEMMs the target runs (XLA or our Pallas kernels) and with which tile configs",
))

# ----------------------------------------------------------------------------- batching (serving)

SERVING_STEPS = (0, 1, 4, 16)  # 0: the batch engine (engine.Decoder); n: the serving engine, n steps per call


def _serving_options(config: dict):
    """The serving engine's ServingOptions, or None (stock: the batch engine). Any batching
    mechanism switches to the continuous-batching engine (specjax/serving/); two-level
    verification needs at least 2 drafts (chain drafts or tree nodes); trees verify there with
    every mechanism (the paged attention kernel masks trees of up to MAX_TREE nodes; larger ones
    use XLA's attention, docs/design/serving_trees.md)."""
    from pallas_kernels.paged_attention import MAX_TREE
    budget = int(config.get("serving.budget", 0))
    packed = config.get("serving.packed", "off") == "on"
    steps = int(config.get("serving.steps_per_call", 0))
    k1 = int(config.get("serving.two_level_k1", 0))
    k = int(config.get("drafter.k", 0)) if config.get("drafter.kind", "none") != "none" else 0
    if k == 0:
        budget, k1 = 0, 0
    tree = _tree_spec(config)
    k1 = k1 if 0 < k1 < (k if tree is None else tree.nodes) else 0
    # level 2's token cap: packed chains with two levels only (trees refuse it)
    k2_tokens = int(config.get("serving.two_level_tokens", 0)) if (k1 and packed and tree is None) else 0
    if not (budget or packed or steps or k1):
        return None
    from specjax.serving.state import ServingOptions
    return ServingOptions(budget=budget or None, packed=packed, steps_per_call=max(steps, 1),
                          two_level_k1=k1 or None, two_level_tokens=k2_tokens or None, tree=tree,
                          attention="xla" if tree is not None and tree.nodes + 1 > MAX_TREE
                          else _serving_attention(config))


def _serving_attention(config: dict) -> str:
    """"kernel": the Pallas ragged paged attention kernel on a GPU; elsewhere XLA's (the same
    numbers: the kernel's interpret mode is for tests), as 12-bit weights are read by XLA there."""
    if config.get("serving.attention", "xla") != "kernel":
        return "xla"
    import jax
    return "pallas" if jax.devices()[0].platform == "gpu" else "xla"


def _serving_features(config: dict) -> dict[str, float]:
    opts = _serving_options(config)
    if opts is None:
        return {"serving_budget": 0.0, "serving_packed": 0.0, "serving_steps": 0.0, "serving_k1": 0.0,
                "serving_kv_passes": 1.0, "serving_k2_tokens": 0.0}
    # XLA's paged attention gathers every slot's pages into a contiguous view each layer (read the
    # pages, write the view, read it again): 3 passes over the KV bytes; the kernel reads pages once
    kv_passes = 1.0 if config.get("serving.attention", "xla") == "kernel" else 3.0
    return {"serving_budget": float(opts.budget or 0), "serving_packed": float(opts.packed),
            "serving_steps": float(opts.steps_per_call), "serving_k1": float(opts.two_level_k1 or 0),
            "serving_kv_passes": kv_passes, "serving_k2_tokens": float(opts.two_level_tokens or 0)}


REGISTRY.register(Mechanism(
    name="batching",
    params=(
        ParamDef("serving.budget", "int", low=0, high=4096, default=0,
                 doc="budgeted verification: draft tokens verified per step over the whole batch, the "
                     "highest survival scores first; 0: every slot's k drafts",
                 components=("verify",)),
        ParamDef("serving.packed", "categorical", ("off", "on"), default="off",
                 doc="packed ragged verification: only verified tokens enter the target forward, "
                     "in one flat bucket, no per-slot padding", components=("verify",)),
        ParamDef("serving.steps_per_call", "categorical", SERVING_STEPS, default=0,
                 doc="device-resident steps: admission, verify steps and retirement per device call "
                     "(1: a host round trip every step); 0: the batch engine", components=("host",)),
        ParamDef("serving.two_level_k1", "int", low=0, high=31, default=0,
                 doc="two-level verification: verify the first k1 drafts of every slot, the rest only "
                     "where all k1 passed; 0: one level", components=("verify",)),
        ParamDef("serving.two_level_tokens", "int", low=0, high=4096, default=0,
                 doc="two-level verification's level-2 token cap (packed chains): the promoted slots' "
                     "later drafts with the highest survival scores, at most this many; 0: all of them",
                 components=("verify",)),
        ParamDef("serving.attention", "categorical", ("xla", "kernel"), default="xla",
                 doc="paged attention of the serving engine: XLA (gathers each slot's pages into a "
                     "contiguous view) or the Pallas ragged paged attention kernel (reads the pages "
                     "in place; GPU only, XLA elsewhere)", components=("verify",)),
    ),
    component="verify",
    features=_serving_features,
    apply=lambda c: {"serving": _serving_options(c)},
    doc="the continuous-batching engine's mechanisms (docs/design/serving.md)",
))
