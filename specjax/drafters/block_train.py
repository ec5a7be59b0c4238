"""Training a block drafter by self-distillation (`specjax train-drafter`).

Data: the target's own continuations (greedy and sampled) of real prompts; a held-out split of
prompts measures τ (accepted tokens per verify step) of the drafter in the real chain engine.
Step: the target runs over a batch of sequences once (its tapped hidden states, no gradient); the
drafter's context K/V are built from them; `anchors` random positions per sequence in the
continuation each form a block [token at a, mask x (B - 1)] whose B - 1 outputs are scored against
the sequence's next B - 1 tokens with DFlash's decayed per-position weights exp(-(i - 1) / decay).

Checkpoints: orbax (atomic directory writes) plus a checksummed JSON manifest per step of the
checkpoint's array bytes; a restore recomputes it and refuses a mismatch. The batch and the
dropout-free step depend only on (seed, step), so a run resumed after a kill reproduces the
uninterrupted run exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.atomic import CorruptFileError, read_json_checked, write_json_atomic
from specjax.drafters.block import BlockDrafter, BlockParams
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.params import ModelParams, truncate_layers
from specjax.models.transformer import forward_with_taps


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 8  # sequences per step
    anchors: int = 8  # blocks per sequence per step
    learning_rate: float = 1e-3
    warmup: int = 50
    decay: float = 7.0  # per-position loss weight exp(-(i - 1) / decay), DFlash's decayed loss
    seed: int = 0
    checkpoint_every: int = 100


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Self-distilled sequences, right-padded: tokens [N, S], lengths [N], prompt_lens [N]."""

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lens: np.ndarray

    def check(self) -> None:
        short = int(np.sum(self.lengths - self.prompt_lens < 2))
        if len(self.lengths) == 0 or short == len(self.lengths):
            raise ConfigError(f"training data: no sequence has >= 2 continuation tokens "
                              f"({len(self.lengths)} sequences); generate longer continuations")


def distill(target: ModelParams, cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int,
            seed: int = 0, greedy_fraction: float = 0.5, stop_tokens=()) -> Corpus:
    """The target's own continuations of `prompts`: the first `greedy_fraction` greedy, the rest
    sampled at temperature 1 (the drafter learns what the target says, in both modes)."""
    from specjax.decoding.sequences import GenerationConfig
    from specjax.engine import Decoder
    from specjax.sampling import SamplingConfig
    n_greedy = int(round(greedy_fraction * len(prompts)))
    outs = []
    for part, sampling in ((prompts[:n_greedy], SamplingConfig()),
                           (prompts[n_greedy:], SamplingConfig(temperature=1.0))):
        if part:
            gen = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop_tokens=tuple(stop_tokens))
            res = Decoder(cfg, target, gen).generate(part, seed=seed)
            outs += [p + list(t) for p, t in zip(part, res.tokens)]
    plens = np.array([len(p) for p in prompts], np.int32)  # outs keep the prompts' order
    S = max(len(o) for o in outs)
    tokens = np.zeros((len(outs), S), np.int32)
    for i, o in enumerate(outs):
        tokens[i, :len(o)] = o
    return Corpus(tokens, np.array([len(o) for o in outs], np.int32), plens)


def position_weights(block_size: int, decay: float) -> jax.Array:
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / decay)


def block_loss(params: BlockParams, drafter: BlockDrafter, target: ModelParams, cfg: ModelConfig,
               tokens, lengths, anchors, decay: float):
    """tokens [b, S], lengths [b], anchors [b, A] (slots of each block's first token) -> mean
    weighted cross-entropy of the B - 1 drafts against the sequence's next tokens."""
    b, S = tokens.shape
    bsz = drafter.block_size
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (b, S))
    depth = max(drafter.taps) + 1  # layers past the deepest tap do not feed the drafter
    shallow, shallow_cfg = truncate_layers(target, depth), cfg.with_layers(depth)
    _, feats, _ = forward_with_taps(shallow, shallow_cfg, tokens, positions, init_cache(shallow_cfg, b, S),
                                    jnp.zeros(b, jnp.int32), drafter.taps)
    feats = jax.lax.stop_gradient(feats)
    d = dataclasses.replace(drafter, params=params)
    ctx = d.observe(init_cache(d.cfg, b, S + bsz), feats, jnp.zeros(b, jnp.int32))
    A = anchors.shape[1]
    rows = jnp.repeat(jnp.arange(b), A)
    cache = KVCache(k=[k[rows] for k in ctx.k], v=[v[rows] for v in ctx.v])
    start = anchors.reshape(-1)
    logits = d.forward_block(cache, tokens[rows, start], start)  # [b A, B - 1, V]
    label_pos = start[:, None] + 1 + jnp.arange(bsz - 1)[None, :]
    labels = jnp.take_along_axis(tokens[rows], jnp.minimum(label_pos, S - 1), axis=1)
    valid = label_pos < lengths[rows][:, None]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    w = position_weights(bsz, decay)[None, :] * valid
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def sample_batch(corpus: Corpus, cfg: TrainConfig, step: int):
    """(tokens, lengths, anchors) of one step: a function of (seed, step) alone."""
    rng = np.random.default_rng([cfg.seed, step])
    usable = np.flatnonzero(corpus.lengths - corpus.prompt_lens >= 2)
    idx = rng.choice(usable, size=cfg.batch, replace=len(usable) < cfg.batch)
    lo = np.maximum(corpus.prompt_lens[idx] - 1, 0)  # anchors in the continuation
    hi = corpus.lengths[idx] - 2
    anchors = lo[:, None] + np.floor(rng.random((cfg.batch, cfg.anchors)) * (hi - lo + 1)[:, None]).astype(np.int32)
    return (jnp.asarray(corpus.tokens[idx]), jnp.asarray(corpus.lengths[idx]), jnp.asarray(anchors))


def make_optimizer(cfg: TrainConfig):
    import optax
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(cfg.warmup, 1),
                                               max(cfg.steps, cfg.warmup + 1))
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


def make_step(drafter: BlockDrafter, target: ModelParams, cfg: ModelConfig, tcfg: TrainConfig):
    import optax
    opt = make_optimizer(tcfg)

    @jax.jit
    def step(params, opt_state, drafter, target, tokens, lengths, anchors):
        # drafter and target are arguments, not closed-over constants: the target's weights
        # (and the embedding/head the drafter shares) must not be baked into the program
        loss, grads = jax.value_and_grad(block_loss)(params, drafter, target, cfg, tokens, lengths,
                                                      anchors, tcfg.decay)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, lambda params, opt_state, *batch: step(params, opt_state, drafter, target, *batch)


# ------------------------------------------------------------------ checkpoints

def tree_digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class Checkpoints:
    """orbax steps under `dir/state`, each with a checksummed manifest `dir/manifest-<step>.json`."""

    def __init__(self, directory: str | Path, keep: int = 2):
        import orbax.checkpoint as ocp
        self.dir = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(self.dir / "state", options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True))

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        import orbax.checkpoint as ocp
        self.manager.save(step, args=ocp.args.StandardSave(state))
        self.manager.wait_until_finished()
        write_json_atomic(self.dir / f"manifest-{step}.json", {"step": step, "sha256": tree_digest(state),
                                                               "meta": meta})

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        import orbax.checkpoint as ocp
        manifest_path = self.dir / f"manifest-{step}.json"
        try:
            manifest = read_json_checked(manifest_path)
        except FileNotFoundError:
            raise CorruptFileError(f"{manifest_path}: missing (checkpoint step {step} is incomplete)") from None
        try:
            state = self.manager.restore(step, args=ocp.args.StandardRestore(like))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds on damaged files
            raise CorruptFileError(f"{self.dir / 'state' / str(step)}: unreadable checkpoint "
                                   f"({type(e).__name__}: {str(e)[:200]})") from None
        if tree_digest(state) != manifest["sha256"]:
            raise CorruptFileError(f"{self.dir / 'state' / str(step)}: checksum mismatch with "
                                   f"{manifest_path.name} (damaged or partial checkpoint)")
        return state, manifest["meta"]


def train(drafter: BlockDrafter, target: ModelParams, cfg: ModelConfig, corpus: Corpus,
          tcfg: TrainConfig, checkpoint_dir: str | Path, meta: dict | None = None,
          stop_after: int | None = None, progress=None, deadline: float | None = None
          ) -> tuple[BlockDrafter, list[float]]:
    """Train (or resume) to tcfg.steps; `stop_after` ends early after that step (tests use it to
    simulate a kill), `deadline` (time.monotonic()) after the first step past it, checkpointed
    either way (the run is the first `done` steps of the full schedule: rerun with stop_after=done
    to reproduce it). progress(step, loss) is called every step. Returns the drafter and losses
    of the steps run in this call."""
    corpus.check()
    opt, step_fn = make_step(drafter, target, cfg, tcfg)
    ckpt = Checkpoints(checkpoint_dir)
    state = {"params": drafter.params, "opt_state": opt.init(drafter.params)}
    first = 0
    if (latest := ckpt.latest()) is not None:
        state, _ = ckpt.restore(latest, state)
        first = latest
    params, opt_state = state["params"], state["opt_state"]
    losses = []
    meta = dict(meta or {}, taps=list(drafter.taps), block_size=drafter.block_size,
                layers=len(drafter.params.layers), conv=drafter.params.conv is not None,
                intermediate_size=drafter.cfg.intermediate_size, train=dataclasses.asdict(tcfg),
                target={"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
                        "vocab_size": cfg.vocab_size})
    for step in range(first, tcfg.steps):
        params, opt_state, loss = step_fn(params, opt_state, *sample_batch(corpus, tcfg, step))
        losses.append(float(loss))
        if progress is not None:
            progress(step + 1, losses[-1])
        done = step + 1
        late = deadline is not None and time.monotonic() > deadline
        if done % tcfg.checkpoint_every == 0 or done == tcfg.steps or done == stop_after or late:
            ckpt.save(done, {"params": params, "opt_state": opt_state}, meta)
        if done == stop_after or late:
            break
    ckpt.manager.close()
    return dataclasses.replace(drafter, params=params), losses


def _param_names(params: BlockParams) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def export_block_drafter(drafter: BlockDrafter, path: str | Path, target_cfg: ModelConfig,
                         dtype: str = "bfloat16") -> int:
    """The drafter's own weights (no optimizer state, no shared target arrays) as one safetensors
    file with its settings and a sha256 of the tensors in the metadata, written atomically.
    bf16 halves it (a drafter's precision moves acceptance only, never the output). -> bytes."""
    import json

    from safetensors.numpy import save

    from specjax.atomic import write_bytes_atomic
    def stored(a):  # safetensors.numpy has no bf16: its bit patterns are stored as uint16
        if dtype == "bfloat16":
            return np.asarray(jnp.asarray(a, jnp.bfloat16)).view(np.uint16)
        return np.asarray(a, dtype)

    names = _param_names(drafter.params)
    arrays = {n: stored(a) for n, a in zip(names, jax.tree.leaves(drafter.params))}
    meta = {"taps": list(drafter.taps), "block_size": drafter.block_size, "layers": len(drafter.params.layers),
            "conv": drafter.params.conv is not None, "intermediate_size": drafter.cfg.intermediate_size,
            "dtype": dtype, "target": {"hidden_size": target_cfg.hidden_size, "num_layers": target_cfg.num_layers,
                                       "vocab_size": target_cfg.vocab_size}}
    digest = tree_digest([arrays[n] for n in names])
    data = save(arrays, metadata={"specjax_block_drafter": json.dumps(meta), "sha256": digest})
    write_bytes_atomic(path, data)
    return len(data)


def _load_exported(path: Path, target: ModelParams, target_cfg: ModelConfig) -> BlockDrafter:
    import json

    from safetensors import safe_open
    from safetensors.numpy import load_file

    from specjax.drafters.block import attach, init_block_drafter
    try:
        with safe_open(str(path), "np") as f:
            header = f.metadata() or {}
        arrays = load_file(str(path))
        meta = json.loads(header["specjax_block_drafter"])
    except Exception as e:  # noqa: BLE001 - safetensors' own error type is not an OSError/ValueError
        raise CorruptFileError(f"{path}: not a readable block-drafter file ({type(e).__name__})") from None
    _check_target(path, meta, target_cfg)
    skeleton = init_block_drafter(target, target_cfg, jax.random.PRNGKey(0), meta["block_size"], meta["layers"],
                                  meta["taps"], meta["conv"], intermediate_size=meta.get("intermediate_size"))
    names = _param_names(skeleton.params)
    if sorted(names) != sorted(arrays) or tree_digest([arrays[n] for n in names]) != header.get("sha256"):
        raise CorruptFileError(f"{path}: checksum or tensor names do not match its header (damaged file)")
    leaves = []
    for n, like in zip(names, jax.tree.leaves(skeleton.params)):
        a = arrays[n]
        if meta["dtype"] == "bfloat16":
            a = jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.bfloat16)
        leaves.append(jnp.asarray(a).astype(like.dtype))
    params = jax.tree.unflatten(jax.tree.structure(skeleton.params), leaves)
    return attach(params, target, target_cfg, meta["taps"], meta["block_size"], name=str(path))


def _check_target(where, meta: dict, target_cfg: ModelConfig) -> None:
    want = meta.get("target", {})
    have = {"hidden_size": target_cfg.hidden_size, "num_layers": target_cfg.num_layers,
            "vocab_size": target_cfg.vocab_size}
    wrong = {k: (v, have[k]) for k, v in want.items() if k in have and have[k] != v}
    if wrong:
        raise ConfigError(f"{where}: drafter trained for another target: "
                          + ", ".join(f"{k} {a} (this target: {b})" for k, (a, b) in wrong.items()))


def load_block_drafter(directory: str | Path, target: ModelParams, target_cfg: ModelConfig) -> BlockDrafter:
    """A trained block drafter attached to `target` (checked against it): an exported
    `.safetensors` file, or the latest checkpoint of a `train-drafter` run directory."""
    from specjax.drafters.block import attach, init_block_drafter
    if Path(directory).suffix == ".safetensors":
        if not Path(directory).is_file():
            raise ConfigError(f"{directory}: block-drafter file not found")
        return _load_exported(Path(directory), target, target_cfg)
    ckpt = Checkpoints(directory)
    step = ckpt.latest()
    if step is None:
        raise ConfigError(f"{directory}: no block-drafter checkpoint (run `specjax train-drafter`)")
    meta = read_json_checked(ckpt.dir / f"manifest-{step}.json")["meta"]
    _check_target(directory, meta, target_cfg)
    skeleton = init_block_drafter(target, target_cfg, jax.random.PRNGKey(0), meta["block_size"],
                                  meta["layers"], meta["taps"], meta["conv"],
                                  intermediate_size=meta.get("intermediate_size"))
    opt = make_optimizer(TrainConfig(**meta["train"]))
    state, _ = ckpt.restore(step, {"params": skeleton.params, "opt_state": opt.init(skeleton.params)})
    ckpt.manager.close()
    return attach(state["params"], target, target_cfg, meta["taps"], meta["block_size"], name=str(directory))
