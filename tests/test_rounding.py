"""Roundings the compiler may not change (specjax/rounding.py): `round_like` rounds exactly as a cast
does, `exact_jit` hands XLA its options, the engine's programs are compiled with it, and the model
code states no rounding as a float32 -> 16-bit -> float32 convert pair, the pattern XLA's GPU
pipeline may drop in one program and keep in another (2026-12-08, H100: RoPE's cos rounded that way
made a 5-token verify step part from 5 AR steps at layer 0). The GPU behaviour itself cannot be
shown on the CPU backend, which keeps every rounding."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from conftest import tiny_config
from specjax.models.kv_cache import init_cache
from specjax.models.params import init_random_params
from specjax.models.transformer import forward
from specjax.rounding import exact_jit, round_like

ROOT = Path(__file__).resolve().parents[1]
SIXTEEN = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# ops that move or copy values without computing: a convert pair across them is still a pair
MOVES = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice",
         "copy", "copy_p", "gather", "concatenate"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_like_rounds_as_a_cast(dtype):
    rng = np.random.default_rng(0)
    v = rng.integers(0, 2 ** 32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [0.0, -0.0, 2 ** -14, -2 ** -14, 2 ** -24, 2 ** -25, 3 * 2 ** -25, 65504, 65520, 1e30, -1e-40]
    v = np.concatenate([v[np.isfinite(v)], np.linspace(-1, 1, 100_001, dtype=np.float32),
                        np.float32(edges)])
    got = np.asarray(round_like(jnp.asarray(v), dtype)).view(np.uint32)
    want = np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32)).view(np.uint32)
    np.testing.assert_array_equal(got, want)


def test_exact_jit_passes_its_options_to_xla():
    f = exact_jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) * 3)
    assert float(f(jnp.float32(1.0 + 2 ** -10))) == 3.0  # the rounding stays
    bogus = exact_jit(lambda x: x + 1, compiler_options={"xla_no_such_option_here": True})
    with pytest.raises(Exception, match="xla_no_such_option_here"):
        bogus.lower(1.0).compile()  # the caller's options are merged, not dropped


def test_engine_programs_use_exact_jit():
    """Every program of the decode and serving paths is compiled with excess precision off."""
    files = [ROOT / "specjax" / "forcing.py", ROOT / "specjax" / "engine.py"]
    files += sorted((ROOT / "specjax" / "decoding").glob("*.py")) + sorted((ROOT / "specjax" / "serving").glob("*.py"))
    bare = [f"{f.relative_to(ROOT)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r"\bjax\.jit\b", line) and not line.lstrip().startswith("#")]
    assert not bare, f"jax.jit without exact rounding (use specjax.rounding.exact_jit): {bare}"


def convert_round_trips(jaxpr, out=None):
    """float32 -> 16-bit -> float32 converts (through MOVES), unless the float32 value goes straight
    into a reduce_precision (a rounding no pass drops)."""
    out = [] if out is None else out
    made, used = {}, {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, jcore.Var):
                used.setdefault(v, []).append(e.primitive.name)
    for e in jaxpr.eqns:
        for p in e.params.values():
            for j in (p if isinstance(p, (list, tuple)) else [p]):
                if isinstance(j, jcore.ClosedJaxpr):
                    convert_round_trips(j.jaxpr, out)
                elif isinstance(j, jcore.Jaxpr):
                    convert_round_trips(j, out)
        for v in e.outvars:
            made[v] = e
        if e.primitive.name != "convert_element_type" or e.params["new_dtype"] != jnp.float32:
            continue
        src = e.invars[0]
        while isinstance(src, jcore.Var) and src in made and made[src].primitive.name in MOVES:
            src = made[src].invars[0]
        prev = made.get(src) if isinstance(src, jcore.Var) else None
        if (prev is not None and prev.primitive.name == "convert_element_type"
                and prev.params["new_dtype"] in SIXTEEN and prev.invars[0].aval.dtype == jnp.float32
                and set(used.get(e.outvars[0], [])) != {"reduce_precision"}):
            from jax._src import source_info_util
            out.append(source_info_util.summarize(e.source_info))
    return out


def dense_target():
    cfg = tiny_config(dtype="bfloat16")
    return forward, cfg, init_random_params(cfg, jax.random.PRNGKey(0)), init_cache(cfg, 2, 32)


def hybrid_target():
    from specjax.models.hybrid import hybrid_forward, init_hybrid_cache, init_random_hybrid_params
    from test_hybrid_decoding import hybrid_config
    cfg = dataclasses.replace(hybrid_config(0), dtype="bfloat16")
    return hybrid_forward, cfg, init_random_hybrid_params(cfg, jax.random.PRNGKey(0)), init_hybrid_cache(cfg, 2, 32)


@pytest.mark.parametrize("target", [dense_target, hybrid_target], ids=["dense", "hybrid"])
def test_forward_states_no_rounding_as_a_convert_pair(target):
    fwd, cfg, params, cache = target()
    toks = jnp.ones((2, 5), jnp.int32)
    pos = jnp.arange(5)[None].repeat(2, 0)
    jaxpr = jax.make_jaxpr(lambda p, c: fwd(p, cfg, toks, pos, c, jnp.zeros(2, jnp.int32)))(params, cache)
    assert convert_round_trips(jaxpr.jaxpr) == []


def test_the_audit_finds_a_convert_pair():
    """The check above can fail: RoPE as it was on 2026-12-07 (cos rounded by a convert pair)."""
    def old_rope(x, cos):
        c = cos.astype(x.dtype)[:, None]
        return (x.astype(jnp.float32) * c.astype(jnp.float32)).astype(x.dtype)
    jaxpr = jax.make_jaxpr(old_rope)(jnp.ones((3, 4), jnp.bfloat16), jnp.ones((3,), jnp.float32))
    assert len(convert_round_trips(jaxpr.jaxpr)) == 1
