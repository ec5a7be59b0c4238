"""The weights and kernels mechanisms: registry entries, cost-model terms, device fields and
calibration, the new spec, and how the search hands them to the engine and gates them."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from specjax.atomic import write_json_atomic
from specjax.costmodel.hardware import DeviceModel, calibrate_kernels, load_calibration
from specjax.costmodel.model import KMAX, ModelDims, predict
from specjax.errors import ConfigError
from specjax.search.evaluate import Evaluator, Measurement, Plan, cost_inputs, engine_changes
from specjax.search.registry import LH12_NOMINAL_BITS, REGISTRY
from specjax.search.spec import load_spec

DEV = DeviceModel("test", bandwidth=1e9, flops=1e12, step_overhead=1e-3, round_overhead=2e-3,
                  peak_bandwidth=2e9, peak_flops=2e12)
# 10 layers of 1 MB (attn 0.25 MB, mlp 0.7 MB, norms and the rest 0.05 MB), a 2 MB head (1.9 MB lm_head)
DIMS = ModelDims(layer_bytes=1e6, head_bytes=2e6, layer_flops=1e6, head_flops=2e6, kv_bytes_per_slot=0.0,
                 attn_flops_per_slot=0.0, num_layers=10, num_slots=64, attn_bytes=0.25e6, mlp_bytes=0.7e6,
                 head_matrix_bytes=1.9e6)
R = LH12_NOMINAL_BITS / 16.0
GROUPS = ("attn", "mlp", "head")


def run(configs, dims=DIMS, dev=DEV, kind=0, k=0, layers=0):
    inputs = cost_inputs(configs, {})
    inputs.update(k=np.full(len(configs), k), kind=np.full(len(configs), kind),
                  layers=np.full(len(configs), layers), alpha=np.full((len(configs), KMAX), 1.0))
    return predict(dims, dev, **inputs)


def fmt(attn="bf16", mlp="bf16", head="bf16", tiles="default"):
    return {"weights.attn": attn, "weights.mlp": mlp, "weights.head": head, "kernels.tiles": tiles}


def test_registry_params_defaults_apply_and_features():
    params = REGISTRY.params()
    for g in GROUPS:
        p = params[f"weights.{g}"]
        assert (p.kind, p.values, p.default) == ("categorical", ("bf16", "lh12"), "bf16")
        assert set(p.components) == {"verify", "draft"}
    tiles = params["kernels.tiles"]
    assert (tiles.values, tiles.default) == (("default", "tuned"), "default")
    assert {"weights.attn", "weights.mlp", "weights.head", "kernels.tiles"} <= set(REGISTRY.params_for("draft"))
    assert REGISTRY.stock()["weights.mlp"] == "bf16" and REGISTRY.stock()["kernels.tiles"] == "default"

    kw = REGISTRY.apply({"drafter.kind": "none", "weights.mlp": "lh12", "kernels.tiles": "tuned"})
    assert kw["weights_format"] == {"attn": "bf16", "mlp": "lh12", "head": "bf16"}
    assert kw["kernel_tiles"] == "tuned"
    assert REGISTRY.apply({"drafter.kind": "none"})["weights_format"] == dict.fromkeys(GROUPS, "bf16")
    f = REGISTRY.features(fmt(mlp="lh12", tiles="tuned"))
    assert f["weights_mlp_bytes"] == pytest.approx(R) and f["weights_attn_bytes"] == 1.0
    assert (f["weights_mlp_lh12"], f["weights_head_lh12"], f["kernels_tuned"]) == (1.0, 0.0, 1.0)


def test_engine_changes_only_away_from_stock():
    assert engine_changes({"drafter.kind": "ngram", "drafter.k": 4}) == {}
    assert engine_changes(fmt()) == {}
    assert engine_changes(fmt(head="lh12")) == {"weights_format": {"attn": "bf16", "mlp": "bf16", "head": "lh12"}}
    assert engine_changes(fmt(tiles="tuned")) == {"kernel_tiles": "tuned"}


def test_all_bf16_predicts_exactly_what_it_did_before():
    old_style = dataclasses.replace(DIMS, attn_bytes=0.0, mlp_bytes=0.0, head_matrix_bytes=0.0)
    k, kind, layers, alpha = [3, 0, 5], [2, 0, 1], [4, 0, 0], np.full((3, KMAX), 0.7)
    before = predict(old_style, DEV, k, kind, layers, alpha)
    plain = predict(DIMS, DEV, k, kind, layers, alpha)
    explicit = predict(DIMS, DEV, k, kind, layers, alpha, np.ones((3, 3)), np.zeros((3, 3)), np.zeros(3))
    for key in before:
        assert np.array_equal(before[key], plain[key]) and np.array_equal(before[key], explicit[key]), key


def test_lh12_groups_shrink_the_weight_read():
    p = run([fmt(), fmt(mlp="lh12"), fmt("lh12", "lh12", "lh12")])
    verify, floor = p["component_time"][:, 0], p["component_floor"][:, 0]
    bf16_read = 10 * 1e6 + 2e6
    assert verify[0] == pytest.approx(1e-3 + bf16_read / 1e9)
    assert verify[1] == pytest.approx(1e-3 + (bf16_read - 10 * 0.7e6 * (1 - R)) / 1e9)
    assert verify[2] == pytest.approx(1e-3 + (bf16_read - (10 * 0.95e6 + 1.9e6) * (1 - R)) / 1e9)
    assert verify[0] > verify[1] > verify[2] and floor[0] > floor[1] > floor[2]
    assert p["tokens_per_s"][2] > p["tokens_per_s"][0]


def test_kernel_efficiencies_and_layer_skip_drafts():
    slow = dataclasses.replace(DEV, lh12_efficiency=0.5, tuned_efficiency=1.25)
    p = run([fmt(), fmt(mlp="lh12"), fmt(tiles="tuned")], dev=slow, kind=2, k=3, layers=2)
    verify, floor = p["component_time"][:, 0], p["component_floor"][:, 0]
    assert verify[1] > verify[0]  # an LH12 kernel at half the read rate loses its 25% of bytes
    assert floor[1] < floor[0]  # floors take the fewer bytes, never the efficiencies
    tuned_read = 10 * 1e6 + 2e6 - (10 * 0.95e6 + 1.9e6) * (1 - 1 / 1.25)
    assert verify[2] == pytest.approx(1e-3 + tuned_read / 1e9) and floor[2] == floor[0]
    draft = p["component_time"][:, 1]  # layer-skip streams the same weights: they move too
    assert draft[1] > draft[0] > draft[2]
    ngram = run([fmt(), fmt("lh12", "lh12", "lh12")], dev=slow, kind=1, k=3)
    assert ngram["component_time"][0, 1] == ngram["component_time"][1, 1]


def test_measured_group_bits_replace_the_nominal_figure():
    dims = dataclasses.replace(DIMS, lh12_bits=(12.0, 12.0, 16.0))  # the head stays bf16 in this target
    slow = dataclasses.replace(DEV, lh12_efficiency=0.5)
    p = run([fmt(), fmt(attn="lh12"), fmt(head="lh12")], dims=dims)
    assert p["component_time"][1, 0] == pytest.approx(1e-3 + (12e6 - 10 * 0.25e6 * 0.25) / 1e9)
    q = run([fmt(), fmt(head="lh12")], dims=dims, dev=slow)
    assert q["component_time"][0, 0] == q["component_time"][1, 0]  # no LH12 tensor, no LH12 kernel
    assert p["component_time"][2, 0] == p["component_time"][0, 0]


def test_model_dims_split_layer_bytes_by_group():
    from conftest import tiny_config
    cfg = tiny_config(dtype="bfloat16")  # D 32, q 32, kv 16, F 64, V 64
    d = ModelDims.of(cfg, 64)
    assert d.attn_bytes == 2 * (32 * 64 + 32 * 32) and d.mlp_bytes == 2 * 3 * 32 * 64
    assert d.layer_bytes == d.attn_bytes + d.mlp_bytes + 2 * 2 * 32
    assert d.head_matrix_bytes == 2 * 64 * 32 and d.head_bytes == d.head_matrix_bytes + 2 * 32


def test_device_model_old_files_load_and_kernel_calibration(tmp_path):
    old = {k: v for k, v in dataclasses.asdict(DEV).items()
           if k not in ("lh12_efficiency", "tuned_efficiency", "kernels_source")}
    write_json_atomic(tmp_path / "calibration" / "old.json", old)
    dev = load_calibration(tmp_path, "old")
    assert (dev.lh12_efficiency, dev.tuned_efficiency) == (1.0, 1.0)

    skipped, note = calibrate_kernels(dev)  # this machine has no GPU
    assert "needs a GPU (found cpu)" in note and "needs a GPU" in skipped.kernels_source
    assert (skipped.lh12_efficiency, skipped.tuned_efficiency) == (1.0, 1.0)

    def fake(shape, fmt, cfg, tokens):  # LH12 0.9 of bf16's time, XLA 0.95; 8 warps are 20% faster
        if fmt == "xla":
            return 0.95
        return (0.9 if fmt == "lh12" else 1.0) * (0.8 if cfg.num_warps == 8 else 1.0)
    shape = (256, 512)
    measured, _ = calibrate_kernels(dev, shape=shape, store_dir=tmp_path, time_fn=fake)
    assert measured.lh12_efficiency == pytest.approx(R / 0.9) and measured.tuned_efficiency == 1.0
    assert measured.pallas_efficiency == pytest.approx(0.95)
    from specjax.search.kernel_tuner import default_tiles, write_entries
    tuned = dataclasses.asdict(dataclasses.replace(default_tiles(shape), num_warps=8))
    write_entries(tmp_path / "kernels" / f"{dev.name}.json", dev.name, {"256x512": {"bf16": tuned, "lh12": tuned}})
    measured, note = calibrate_kernels(dev, shape=shape, store_dir=tmp_path, time_fn=fake)
    assert measured.tuned_efficiency == pytest.approx(1 / 0.8) and "256x512" in measured.kernels_source


def test_kernels_spec_loads_and_lh12_needs_bf16(tmp_path):
    spec = load_spec("search_specs/h200_kernels.yaml")
    assert {"weights.attn", "weights.mlp", "weights.head", "kernels.tiles"} <= set(spec.space)
    assert spec.is_valid(spec.canonical(spec.stock)) and engine_changes(spec.stock) == {}
    text = open("search_specs/h200_kernels.yaml").read().replace("dtype: bfloat16", "dtype: float32")
    (tmp_path / "f32.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"f32.yaml:\d+: space.weights.attn: lh12 is lossless over bf16"):
        load_spec(str(tmp_path / "f32.yaml"))


def test_search_refuses_knobs_the_engine_does_not_take(monkeypatch):
    import specjax.engine
    from specjax.search.run import check_engine_supports
    spec = load_spec("search_specs/h200_kernels.yaml")

    class Old:
        def __init__(self, cfg, params, gen, drafter=None, min_prompt_bucket=0):
            pass

    class New(Old):
        def __init__(self, *a, weights_format=None, kernel_tiles="default", **kw):
            pass
    monkeypatch.setattr(specjax.engine, "Decoder", Old)
    with pytest.raises(ConfigError, match=r"space.weights.attn: 'lh12' needs an engine that takes weights_format="):
        check_engine_supports(spec)
    check_engine_supports(load_spec("search_specs/h200.yaml"))  # nothing new in that space
    monkeypatch.setattr(specjax.engine, "Decoder", New)
    check_engine_supports(spec)


def test_builder_gets_the_knobs_only_when_not_stock(monkeypatch):
    import specjax.search.evaluate as ev
    built = []
    monkeypatch.setattr(ev, "Decoder", lambda *a, **kw: built.append(kw))
    fake = types.SimpleNamespace(target=types.SimpleNamespace(cfg=None, params=None), gen=None, bucket=8)
    Evaluator._build(fake, {"drafter.kind": "none", **fmt()})
    Evaluator._build(fake, {"drafter.kind": "none", **fmt(attn="lh12", tiles="tuned")})
    assert built[0] == {"min_prompt_bucket": 8}
    assert built[1]["weights_format"]["attn"] == "lh12" and built[1]["kernel_tiles"] == "tuned"


def test_plain_gate_for_ar_on_other_weights():
    ref = types.SimpleNamespace(tokens=[[5, 6, 7, 8]], margins=[[1.0, 0.0001, 2.0, 2.0]])

    def gate(tokens):
        dec = types.SimpleNamespace(generate=lambda batch: types.SimpleNamespace(tokens=[tokens]))
        fake = types.SimpleNamespace(decoder=lambda c: dec, batches=[[[1, 2]]], references=[ref],
                                     forcing_tolerance=1e-3)
        m = Measurement.failed(fmt(mlp="lh12"), "", "cpu")
        m.rejected = None
        return Evaluator._gate_plain(fake, m)
    assert gate([5, 6, 7, 8]).valid
    assert gate([5, 9, 1, 1]).valid  # first difference at a near tie (margin 1e-4)
    bad = gate([5, 6, 9, 8])
    assert not bad.valid and "position 2" in bad.rejected and bad.forcing["failures"] == 1


def test_floor_and_defaults_in_the_loop(tmp_path):
    from conftest import tiny_model
    from specjax.models.loading import LoadedModel
    from specjax.search.loop import Search
    cfg, params = tiny_model(dtype="bfloat16")
    plan = Plan(LoadedModel("tiny", cfg, params, None), [[1, 2, 3]], 8, DEV, "cpu")
    assert plan.floor_seconds(fmt("lh12", "lh12", "lh12"), 64) < plan.floor_seconds(fmt(), 64)
    plan.lh12_bits = (16.0, 16.0, 16.0)  # nothing compresses: the floor stays
    assert plan.floor_seconds(fmt("lh12", "lh12", "lh12"), 64) == plan.floor_seconds(fmt(), 64)

    spec = load_spec("search_specs/h200_kernels.yaml")
    search = Search(spec, None, None, tmp_path)
    ar = search._ar_config()
    assert ar == {"drafter.kind": "none", **fmt()} and spec.is_valid(spec.canonical(ar))
    assert Search(load_spec("search_specs/h200.yaml"), None, None, tmp_path)._ar_config() == {"drafter.kind": "none"}


def test_kernels_backend_knob(monkeypatch):
    p = REGISTRY.params()["kernels.backend"]
    assert (p.values, p.default) == (("xla", "pallas"), "xla")
    pallas = {**fmt(), "kernels.backend": "pallas"}
    assert REGISTRY.features(fmt())["kernels_pallas"] == 0.0
    assert REGISTRY.features(pallas)["kernels_pallas"] == 1.0
    # 12-bit weights and tuned tiles are read by the kernels only: they imply them
    assert REGISTRY.features(fmt(mlp="lh12"))["kernels_pallas"] == 1.0
    assert REGISTRY.features(fmt(tiles="tuned"))["kernels_pallas"] == 1.0
    # on this CPU the engine runs XLA (the kernels' interpret mode is for tests): no engine change
    assert REGISTRY.apply(pallas)["kernels"] == "xla" and engine_changes(pallas) == {}
    monkeypatch.setattr("jax.devices", lambda *a: [types.SimpleNamespace(platform="gpu")])
    assert engine_changes(pallas) == {"kernels": "pallas"}
    assert engine_changes(fmt(attn="lh12"))["kernels"] == "pallas"
    assert engine_changes(fmt()) == {}


def test_pallas_efficiency_prices_the_kernels():
    slow = dataclasses.replace(DEV, pallas_efficiency=0.5)
    configs = [fmt(), {**fmt(), "kernels.backend": "pallas"}]
    p = run(configs, dev=slow)
    verify, floor = p["component_time"][:, 0], p["component_floor"][:, 0]
    matrices = 10 * 0.95e6 + 1.9e6  # the GEMM weights; norms are not read by the kernels
    assert verify[1] == pytest.approx(verify[0] + matrices / 1e9)  # half the rate: twice the time
    assert floor[1] == floor[0]  # the floor is the bytes, whatever reads them
    same = run(configs)["component_time"]  # at pallas_efficiency 1.0 the knob costs nothing
    assert np.array_equal(same[0], same[1])
