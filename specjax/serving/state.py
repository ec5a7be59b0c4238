"""The serving engine's device state: slots, the paged cache, the request queue and the outbox.
All shapes are static (see docs/design/serving.md); the host only appends to the queue, names
requests to cancel, and reads the outbox and the slots' progress."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.chain import Forced
from specjax.decoding.sequences import Sequences
from pallas_kernels.paged_attention import MAX_TREE
from specjax.errors import ConfigError
from specjax.serving.paged_cache import TRASH_PAGE, PagedKVCache, init_paged_cache


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """The batching mechanisms, each a switch (static: one compiled step per combination).

    budget: verify at most this many draft tokens per step over the whole batch, the best by
        survival score (None: every slot's k drafts).
    packed: pack the verified tokens of all slots into one flat bucket of B + budget tokens
        (B (k + 1) without a budget); off: every slot takes k + 1 tokens, busy or not.
    steps_per_call: steps (with admission and retirement) per device call; 1 is a host loop.
    two_level_k1: verify the first k1 drafts of every slot, then the rest only where all k1 were
        accepted (None: one level). Level 2 runs only when some slot passed level 1. Trees: the
        first k1 nodes, then the rest only where the accepted walk reaches past them.
    two_level_tokens: packed level-2 bucket (draft tokens; default: the draft budget). When more
        promoted drafts than this remain, the best by survival score are verified.
    attention: the verify steps' attention over the paged cache: "xla" (each row's pages gathered
        into a view), "pallas" (the ragged paged attention kernel, `pallas_kernels/paged_attention.py`;
        GPU) or "interpret" (that kernel in Pallas interpret mode, for CPU tests).
    tree: verify a tree of drafts per slot instead of a chain (a `TreeSpec`, or a `TreeShape` for
        the static builder; docs/design/serving_trees.md). With a budget, each slot verifies the
        first nodes of its tree (parents before children) that the budget admits.
    batched_prefill: prefill the requests admitted together in one forward (dense targets;
        `serving/admit_group.py`); off: one forward per request.
    """
    budget: int | None = None
    packed: bool = False
    steps_per_call: int = 1
    two_level_k1: int | None = None
    two_level_tokens: int | None = None
    attention: str = "xla"
    tree: object = None
    batched_prefill: bool = True

    def check(self, k: int, num_slots: int) -> "ServingOptions":
        if self.budget is not None and not 1 <= self.budget:
            raise ConfigError(f"serving budget must be >= 1 draft token, got {self.budget}")
        if self.steps_per_call < 1:
            raise ConfigError(f"steps_per_call must be >= 1, got {self.steps_per_call}")
        if self.two_level_k1 is not None and self.tree is None and not 1 <= self.two_level_k1 < k:
            raise ConfigError(f"two_level_k1 must be in [1, k) = [1, {k}), got {self.two_level_k1}")
        if self.two_level_tokens is not None and (self.two_level_k1 is None or not self.packed
                                                  or self.two_level_tokens < 1):
            raise ConfigError("two_level_tokens (>= 1) sizes the packed level-2 bucket: it needs "
                              "two_level_k1 and packed")
        if k == 0 and (self.budget is not None or self.two_level_k1 is not None):
            raise ConfigError("budget and two-level verification need a drafter")
        if self.attention not in ("xla", "pallas", "interpret"):
            raise ConfigError(f"serving attention must be xla, pallas or interpret, got {self.attention!r}")
        if self.tree is not None:
            from specjax.trees.builders import as_tree_spec
            if k == 0:
                raise ConfigError("tree verification needs a drafter")
            if self.two_level_tokens is not None:
                raise ConfigError("two_level_tokens cannot cut a tree's second level: which nodes it "
                                  "keeps would follow level 1's acceptance tests and bias sampling "
                                  "(docs/design/serving_trees.md)")
            spec = as_tree_spec(self.tree)
            if self.attention != "xla" and spec.nodes + 1 > MAX_TREE:
                raise ConfigError(f"the paged attention kernel masks trees of at most {MAX_TREE} nodes "
                                  f"(root included); this tree has {spec.nodes + 1}")
            if self.two_level_k1 is not None and not 1 <= self.two_level_k1 < spec.nodes:
                raise ConfigError(f"two_level_k1 must be in [1, tree nodes) = [1, {spec.nodes}), "
                                  f"got {self.two_level_k1}")
            return dataclasses.replace(self, tree=spec)
        return self

    def drafts(self, k: int) -> int:
        """Draft tokens (tree nodes past the root) one slot verifies at most."""
        return k if self.tree is None else self.tree.nodes

    def overshoot(self, k: int) -> int:
        """Positions past the committed length one step may write, the pending token excluded."""
        return max(k, self.drafts(k))

    def draft_budget(self, k: int, num_slots: int) -> int:
        """Draft tokens one step can verify over the batch."""
        n = self.drafts(k)
        return num_slots * n if self.budget is None else min(self.budget, num_slots * n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
    seqs: Sequences  # [B, L]; free slots are done
    busy: jax.Array  # [B] bool: holds a request (running, or finished and not yet retired)
    rid: jax.Array  # [B] int32 request id
    max_new: jax.Array  # [B] int32
    pages: jax.Array  # [B, L / page_size] block table
    accept_rate: jax.Array  # [B] float32: running per-draft acceptance (budget scores)
    rounds: jax.Array  # [B] int32 verify steps
    committed: jax.Array  # [B] int32 tokens committed by verify steps (tau = committed / rounds)
    accepted_hist: jax.Array  # [B, k + 1] verify steps by number of drafts committed
    failed: jax.Array  # [B] bool: non-finite logits; the request stops, the others go on
    forced: Forced  # [B, L] token-forcing reference and findings (unused unless forcing)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Queue:
    """Admitted in order from index 0; `count` entries are real."""
    tokens: jax.Array  # [Q, P] right-padded prompts
    length: jax.Array  # [Q]
    max_new: jax.Array  # [Q]
    rid: jax.Array  # [Q]
    ref_tokens: jax.Array  # [Q, L] forcing reference (prompt + continuation)
    ref_length: jax.Array  # [Q]
    count: jax.Array  # scalar int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Outbox:
    """Requests retired during the last call (the next call starts with it empty)."""
    tokens: jax.Array  # [O, L]
    length: jax.Array  # [O]
    prompt_len: jax.Array  # [O]
    rid: jax.Array  # [O]
    rounds: jax.Array  # [O]
    committed: jax.Array  # [O]
    accepted_hist: jax.Array  # [O, k + 1]
    failed: jax.Array  # [O]
    mismatch: jax.Array  # [O, L] forcing findings
    engine_token: jax.Array  # [O, L]
    checked: jax.Array  # [O, L]
    count: jax.Array  # scalar int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ServingState:
    slots: Slots
    cache: PagedKVCache
    free: jax.Array  # [num_pages] bool
    dstate: object  # the drafter's state, one row per slot
    queue: Queue
    outbox: Outbox
    key: jax.Array
    # hybrid targets: each slot's GDN states, conv windows and deferred path (a `HybridCache`
    # without K/V, which live in `cache`'s pages); None for dense targets
    recurrent: object = None


def empty_forced(rows: int, length: int) -> Forced:
    z = jnp.zeros((rows, length), jnp.int32)
    return Forced(ref_tokens=z, ref_length=jnp.zeros(rows, jnp.int32), mismatch=z.astype(bool),
                  engine_token=z, checked=z.astype(bool))


def init_state(cfg, drafter, num_slots: int, slot_len: int, page_size: int, num_pages: int,
               queue_len: int, prompt_width: int, outbox_len: int, seed: int) -> ServingState:
    B, L = num_slots, slot_len
    k = 0 if drafter is None else drafter.k
    zi = jnp.zeros(B, jnp.int32)
    seqs = Sequences(tokens=jnp.zeros((B, L), jnp.int32), length=jnp.ones(B, jnp.int32),
                     prompt_len=zi, done=jnp.ones(B, bool), margins=jnp.full((B, L), jnp.inf))
    slots = Slots(seqs=seqs, busy=jnp.zeros(B, bool), rid=zi - 1, max_new=zi,
                  pages=jnp.full((B, L // page_size), TRASH_PAGE, jnp.int32),
                  accept_rate=jnp.full(B, 0.5, jnp.float32), rounds=zi, committed=zi,
                  accepted_hist=jnp.zeros((B, k + 1), jnp.int32), failed=jnp.zeros(B, bool), forced=empty_forced(B, L))
    Q, O = queue_len, outbox_len
    zq = jnp.zeros(Q, jnp.int32)
    queue = Queue(tokens=jnp.zeros((Q, prompt_width), jnp.int32), length=zq, max_new=zq, rid=zq,
                  ref_tokens=jnp.zeros((Q, L), jnp.int32), ref_length=zq, count=jnp.int32(0))
    zo = jnp.zeros(O, jnp.int32)
    f = empty_forced(O, L)
    outbox = Outbox(tokens=jnp.zeros((O, L), jnp.int32), length=zo, prompt_len=zo, rid=zo, rounds=zo,
                    committed=zo, accepted_hist=jnp.zeros((O, k + 1), jnp.int32), failed=jnp.zeros(O, bool), mismatch=f.mismatch,
                    engine_token=f.engine_token, checked=f.checked, count=jnp.int32(0))
    free = jnp.ones(num_pages, bool).at[TRASH_PAGE].set(False)
    state = ServingState(slots=slots, cache=init_paged_cache(cfg, num_pages, page_size), free=free,
                        dstate=empty_drafter_state(drafter, B, L, prompt_width, cfg),
                        queue=queue, outbox=outbox, key=jax.random.PRNGKey(seed))
    # one buffer per leaf: several leaves above share one zeros array, and a donated call may not
    # receive the same buffer twice
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


def empty_drafter_state(drafter, rows: int, slot_len: int, prompt_width: int, cfg):
    """Zeros shaped like the drafter's state for `rows` slots (rows are filled at admission)."""
    if drafter is None:
        return ()
    prompt = jnp.zeros((rows, prompt_width), jnp.int32)
    lens = jnp.ones(rows, jnp.int32)
    taps = getattr(drafter, "taps", ())
    extra = {"features": jnp.zeros((rows, prompt_width, len(taps) * cfg.hidden_size), jnp.dtype(cfg.dtype))
             } if taps else {}
    shapes = jax.eval_shape(lambda d: d.init(prompt, lens, slot_len, **extra), drafter)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
