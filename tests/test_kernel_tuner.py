"""The kernel tuner with fake timers: the fastest pair, numerics shared by bf16/LH12 and every T,
shapes in gap order, the budget, the checksummed cache, and the CLI on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pallas_kernels.skinny_gemm import GemmConfig, Geometry
from specjax.atomic import CorruptFileError, write_json_atomic
from specjax.cli import main
from specjax.search.kernel_tuner import (BLOCK_K, BLOCK_N, MAX_K_PADDING, MIN_PROGRAMS, NUM_STAGES, NUM_WARPS,
                                         KernelTuner, cache_path, default_tiles, model_shapes,
                                         WIDE_TOKENS, numerics_candidates, parse_shapes, read_cache,
                                         speed_candidates, tuned_config, wide_candidates)

SHAPE = (4096, 4096)
CEILING = 4e12


class TableTimer:
    """Seconds = numerics score (per format and T) x speed factor (per format), so the optimum is known.

    bf16 alone would pick numerics (128, 1), LH12 alone (64, 1); as a pair (256, 1) wins (1.1 + 1.1
    against 1.0 + 1.5 either way). (32, 1) is the fastest of all at T = 1 and the slowest at T = 16:
    a tuner choosing per T would split the numerics."""

    NUMERICS = {"bf16": {(128, 1): 1.0, (256, 1): 1.1, (64, 1): 1.5},
                "lh12": {(64, 1): 1.0, (256, 1): 1.1, (128, 1): 1.5}}
    SPEED = {"bf16": (512, 8, 3), "lh12": (128, 4, 4)}

    def __init__(self):
        self.calls = []

    def __call__(self, shape, fmt, cfg, tokens):
        self.calls.append((shape, fmt, cfg, tokens))
        if cfg.numerics == (32, 1):
            score = 0.1 if tokens == 1 else 5.0
        else:
            score = self.NUMERICS[fmt].get(cfg.numerics, 2.0)
        fast = (cfg.block_n, cfg.num_warps, cfg.num_stages) == self.SPEED[fmt]
        decode = 0.95 if (cfg.decode, cfg.escape_lookup) == ("swar", "masked") else 1.0  # LH12 only
        decode *= 0.97 if fmt == "lh12" and not cfg.one_dot else 1.0  # not the first candidate
        return 1e-4 * score * (0.8 if fast else 1.0) * decode


def tuner(tmp_path, time_fn, **kw):
    kw.setdefault("budget_s", 1e9)
    return KernelTuner(time_fn, "dev", tmp_path, ceiling=CEILING, progress=lambda line: None, **kw)


def test_picks_the_fastest_pair_with_shared_numerics(tmp_path):
    [res] = tuner(tmp_path, TableTimer()).run([SHAPE])
    assert res.best["bf16"] == GemmConfig(block_n=512, block_k=256, split_k=1, num_warps=8, num_stages=3)
    assert res.best["lh12"] == GemmConfig(block_n=128, block_k=256, split_k=1, num_warps=4, num_stages=4,
                                          escape_lookup="masked", decode="swar", one_dot=False)
    assert res.best["bf16"].numerics == res.best["lh12"].numerics
    assert res.baseline == {"bf16": default_tiles(SHAPE), "lh12": default_tiles(SHAPE, "lh12")}
    # every T was timed with the same config: one config per format serves decode and verify
    entry = read_cache(cache_path(tmp_path, "dev"))["4096x4096"]
    assert GemmConfig(**entry["bf16"]).numerics == GemmConfig(**entry["lh12"]).numerics == (256, 1)
    assert set(entry["gbps"]["bf16"]) == {"1", "16"}
    assert entry["gbps"]["bf16"]["1"] == pytest.approx(2 * 4096 * 4096 / (1e-4 * 1.1 * 0.8) / 1e9)
    assert entry["jax"] and entry["measured_at"]


def test_shapes_are_swept_furthest_from_the_ceiling_first(tmp_path):
    eff = {(1024, 1024): 0.9, (2048, 1024): 0.3, (1024, 2048): 0.6}

    def timer(shape, fmt, cfg, tokens):
        calls.append(shape)
        return 2 * shape[0] * shape[1] / (CEILING * eff[shape])
    calls = []
    results = tuner(tmp_path, timer).run(list(eff))
    assert [r.shape for r in results] == [(2048, 1024), (1024, 2048), (1024, 1024)]
    assert results[0].gap(results[0].baseline_s, CEILING) > results[1].gap(results[1].baseline_s, CEILING)
    swept = calls[3 * 4:]  # after the baselines: 3 shapes x 2 formats x 2 T
    assert swept[0] == (2048, 1024) and swept[-1] == (1024, 1024)


def test_budget_is_respected_and_split_by_gap(tmp_path):
    now = [0.0]
    eff = {(1024, 1024): 0.9, (2048, 1024): 0.3}

    def timer(shape, fmt, cfg, tokens):  # each call costs one second of the fake clock
        now[0] += 1.0
        return 2 * shape[0] * shape[1] / (CEILING * eff[shape]) * (0.9 if cfg.num_warps == 8 else 1.0)
    budget = 40.0
    results = tuner(tmp_path, timer, budget_s=budget, clock=lambda: now[0]).run(list(eff))
    assert now[0] <= budget + 2  # at most the candidate in flight (one call per T) runs over
    far, near = results
    assert far.shape == (2048, 1024) and far.tried > near.tried  # the larger gap gets the larger share
    assert all(r.best["bf16"].numerics == r.best["lh12"].numerics for r in results if r.best)

    now[0] = 0.0  # a budget spent during the baselines: nothing swept, nothing written
    short = tuner(tmp_path / "b", timer, budget_s=3.0, clock=lambda: now[0]).run(list(eff))
    assert len(short) == 1 and short[0].best is None
    assert not cache_path(tmp_path / "b", "dev").exists()


def test_cache_round_trip_merge_and_tuned_config(tmp_path):
    timer = TableTimer()
    tuner(tmp_path, timer).run([SHAPE])
    path = cache_path(tmp_path, "dev")
    assert [p.name for p in path.parent.iterdir()] == ["dev.json"]  # no temp file left behind
    assert set(json.loads(path.read_text())) == {"checksum", "payload"}
    best = tuned_config(SHAPE, "bf16", device="dev", store_dir=tmp_path)
    assert best == GemmConfig(block_n=512, block_k=256, split_k=1, num_warps=8, num_stages=3)
    assert tuned_config((64, 64), "lh12", device="dev", store_dir=tmp_path) == default_tiles((64, 64), "lh12")
    assert tuned_config(SHAPE, "bf16", device="other", store_dir=tmp_path) == default_tiles(SHAPE)
    # a second run starts from the cached configs and keeps the other shapes' entries
    results = {r.shape: r for r in tuner(tmp_path, timer).run([(1024, 1024), SHAPE])}
    fresh, again = results[(1024, 1024)], results[SHAPE]
    assert fresh.baseline == {"bf16": default_tiles((1024, 1024)), "lh12": default_tiles((1024, 1024), "lh12")}
    assert again.baseline["bf16"] == best and again.best["bf16"] == best
    assert set(read_cache(path)) == {"4096x4096", "1024x1024"}


def test_corrupt_cache_is_refused_naming_the_file(tmp_path):
    tuner(tmp_path, TableTimer()).run([SHAPE])
    path = cache_path(tmp_path, "dev")
    data = bytearray(path.read_bytes())
    i = data.index(b'"block_k": 256') + len('"block_k": ')
    data[i] = ord("1")  # 256 -> 156: still valid JSON, a wrong checksum
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=str(path).replace("\\", "\\\\") + ".*checksum"):
        tuned_config(SHAPE, "bf16", device="dev", store_dir=tmp_path)
    with pytest.raises(CorruptFileError, match="dev.json"):
        tuner(tmp_path, TableTimer()).run([SHAPE])
    assert path.read_bytes() == bytes(data)  # refused, never overwritten

    # checksum fine but the pair breaks the numerics rule
    entry = {"bf16": dataclasses.asdict(GemmConfig(block_k=64)), "lh12": dataclasses.asdict(GemmConfig(block_k=128))}
    write_json_atomic(path, {"format_version": 1, "device": "dev", "shapes": {"4096x4096": entry}})
    with pytest.raises(CorruptFileError, match="different numerics"):
        tuned_config(SHAPE, "lh12", device="dev", store_dir=tmp_path)


def test_failing_candidates_are_recorded_and_skipped(tmp_path):
    table = TableTimer()

    def timer(shape, fmt, cfg, tokens):
        if cfg.block_n == 512 and fmt == "bf16":
            raise RuntimeError("out of shared memory")
        return table(shape, fmt, cfg, tokens)
    [res] = tuner(tmp_path, timer).run([SHAPE])
    assert res.errors and "out of shared memory" in res.errors[0]
    assert res.best["bf16"].block_n != 512 and res.best["bf16"].numerics == res.best["lh12"].numerics


def test_candidate_space():
    for shape in [(4096, 4096), (14336, 4096), (576, 49152), (576, 960)]:
        cands = numerics_candidates(shape)
        assert cands and len(set(cands)) == len(cands)
        for bk, split in cands:
            assert bk in BLOCK_K
            assert Geometry.of(shape, GemmConfig(block_k=bk, split_k=split)).kp <= MAX_K_PADDING * shape[0]
    # the first candidate fills the GPU: >= 2 programs per SM at the default block_n
    bk, split = numerics_candidates((4096, 4096))[0]
    g = Geometry.of((4096, 4096), GemmConfig(block_k=bk, split_k=split))
    assert g.mp // GemmConfig().block_m * split >= MIN_PROGRAMS
    speed = speed_candidates((64, 1))
    assert len(speed) == len(set(speed)) == len(BLOCK_N) * len(NUM_WARPS) * len(NUM_STAGES)
    assert {c.numerics for c in speed} == {(64, 1)}
    lh12 = speed_candidates((64, 2), "lh12")  # decode options too; numerics fixed
    assert len(lh12) == len(set(lh12)) and {c.numerics for c in lh12} == {(64, 2)}
    assert {(c.decode, c.escape_lookup) for c in lh12} == {(d, e) for d in ("prmt", "swar")
                                                           for e in ("masked", "superword")}


def test_shapes_of_a_model_and_from_text():
    from conftest import tiny_config
    cfg = tiny_config()  # D 32, q 32, kv 16, F 64, V 64
    assert model_shapes(cfg) == [(32, 64), (32, 32), (32, 128), (64, 32)]  # lm_head [32, 64] = w_qkv's
    assert parse_shapes("4096x4096, 4096X14336,4096x4096") == [(4096, 4096), (4096, 14336)]
    with pytest.raises(Exception, match="not INxOUT"):
        parse_shapes("4096by4096")


def test_cli_needs_a_gpu_or_the_fake_timer(tmp_path, capsys):
    assert main(["tune-kernels", "--shapes", "256x512", "--memory", str(tmp_path)]) == 2
    assert "needs a GPU (found cpu)" in capsys.readouterr().err
    assert main(["tune-kernels", "--shapes", "256by512", "--fake-timer"]) == 2
    assert "not INxOUT" in capsys.readouterr().err
    assert main(["tune-kernels", "--shapes", "256x512", "--budget-s", "0", "--fake-timer"]) == 2
    rc = main(["tune-kernels", "--shapes", "256x512,512x256", "--fake-timer", "--budget-s", "5",
               "--memory", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "2 of 2 shapes tuned" in out and "wide steps (T = 64) tuned for 2 of 2" in out
    [cache] = (tmp_path / "kernels").iterdir()
    assert cache.name.endswith("-fake.json") and set(read_cache(cache)) == {"256x512", "512x256"}


class WideTimer(TableTimer):
    """TableTimer, and at T = 64 eight warps with two stages run at 0.7x whatever else (bf16 only:
    12-bit gains nothing at T = 64)."""

    def __call__(self, shape, fmt, cfg, tokens):
        t = super().__call__(shape, fmt, cfg, tokens)
        if tokens == WIDE_TOKENS and fmt == "bf16" and (cfg.num_warps, cfg.num_stages) == (8, 2):
            t *= 0.7
        return t


def test_wide_steps_get_their_own_speed_settings_under_the_pairs_numerics(tmp_path):
    timer = WideTimer()
    tuner(tmp_path, timer).run([SHAPE])
    pair = {f: tuned_config(SHAPE, f, device="dev", store_dir=tmp_path) for f in ("bf16", "lh12")}
    assert pair["bf16"].wide is None
    [res] = tuner(tmp_path, timer).run_wide([SHAPE, (1024, 1024)])  # 1024x1024 has no pair: skipped
    assert res.shape == SHAPE
    wide = tuned_config(SHAPE, "bf16", device="dev", store_dir=tmp_path)
    assert wide.wide is not None and (wide.wide.num_warps, wide.wide.num_stages) == (8, 2)
    assert wide.wide.numerics == wide.numerics == pair["bf16"].numerics
    assert dataclasses.replace(wide, wide=None) == pair["bf16"]  # T <= 16 settings untouched
    assert tuned_config(SHAPE, "lh12", device="dev", store_dir=tmp_path) == pair["lh12"]  # no gain: none
    entry = read_cache(cache_path(tmp_path, "dev"))["4096x4096"]
    assert entry["gbps_wide"]["bf16"]["wide"] > entry["gbps_wide"]["bf16"]["base"]
    assert {t for (*_, t) in timer.calls[-3:]} == {WIDE_TOKENS}
    # a later pair run that keeps the pair keeps its wide settings too
    tuner(tmp_path, timer).run([SHAPE])
    assert tuned_config(SHAPE, "bf16", device="dev", store_dir=tmp_path) == wide


def test_wide_candidates_keep_numerics_and_layout():
    base = GemmConfig(block_n=256, block_k=64, split_k=4)
    bf16 = wide_candidates((4096, 4096), base)
    assert base not in bf16 and len(set(bf16)) == len(bf16)
    assert {c.numerics for c in bf16} == {base.numerics} and {c.block_n for c in bf16} == set(BLOCK_N)
    assert all(c.wide is None for c in bf16)
    assert {c.block_n for c in wide_candidates((4096, 700), base)} == {128, 256}  # 512 pads to 1024, not 768
    lh12 = wide_candidates((4096, 4096), dataclasses.replace(base, block_n=128, one_dot=True), "lh12")
    assert {(c.block_n, c.one_dot) for c in lh12} == {(128, True)} and {c.decode for c in lh12} == {"prmt", "swar"}


def test_cache_with_a_wide_config_of_another_layout_is_refused(tmp_path):
    base = GemmConfig(block_n=128, block_k=64, split_k=1, one_dot=True)
    bad = dataclasses.replace(base, wide=dataclasses.replace(base, block_n=256))
    entry = {"bf16": dataclasses.asdict(GemmConfig(block_k=64)), "lh12": dataclasses.asdict(bad)}
    path = cache_path(tmp_path, "dev")
    write_json_atomic(path, {"format_version": 1, "device": "dev", "shapes": {"4096x4096": entry}})
    with pytest.raises(CorruptFileError, match="4096x4096.lh12.*layout"):
        tuned_config(SHAPE, "bf16", device="dev", store_dir=tmp_path)


def test_wide_budget_is_shared_by_both_formats(tmp_path):
    """Each timing costs a second of a fake clock; with 12 s for one shape both formats get
    candidates past their own settings (bf16 alone has more than 12)."""
    timer = WideTimer()
    tuner(tmp_path, timer).run([SHAPE])
    now = [0.0]

    def ticking(shape, fmt, cfg, tokens):
        now[0] += 1.0
        return timer(shape, fmt, cfg, tokens)
    [res] = tuner(tmp_path, ticking, budget_s=12, clock=lambda: now[0]).run_wide([SHAPE])
    timed = [(fmt, t) for (_, fmt, _, t) in timer.calls if t == WIDE_TOKENS]
    assert timed.count(("bf16", WIDE_TOKENS)) > 2 and timed.count(("lh12", WIDE_TOKENS)) > 2
    assert len(timed) <= 14
