"""Tensor parallelism (docs/design/tensor_parallel.md): with 4 virtual CPU devices, dense and
hybrid targets sharded over 2 and 4 of them generate the unsharded engine's greedy tokens, and
speculative decoding (n-gram, block, small-model drafters, chains and trees, drafter replicated or
sharded; the serving engine with its mechanisms) passes token forcing against the unsharded AR. The cases run in a child process: the
device count is fixed when jax starts. Also here: the placement rules, and refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from conftest import tiny_model
from specjax.errors import ConfigError
from specjax.sharding.tp import TP_AXIS, param_shardings, param_spec, tp_mesh

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("family", ["dense", "hybrid", "serving", "kernels", "kernels_lh12"])
def test_sharded_engine_is_token_exact(family):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    run = subprocess.run([sys.executable, str(HERE / "tp_cases.py"), family], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("ok ") >= {"dense": 10, "hybrid": 10, "serving": 5, "kernels": 3,
                                       "kernels_lh12": 3}[family], run.stdout


def test_placement_rules():
    assert param_spec("w_qkv", (32, 64), 4) == P(None, TP_AXIS)
    assert param_spec("w_down", (64, 32), 4) == P(TP_AXIS, None)
    assert param_spec("A_log", (8,), 4) == P(TP_AXIS)
    assert param_spec("w_o", (30, 32), 4) == P()  # 30 rows do not split 4 ways: replicated
    assert param_spec("attn_norm", (32,), 4) == P() and param_spec("embed", (96, 32), 4) == P()
    cfg, params = tiny_model(seed=1)
    shardings, report = param_shardings(params, tp_mesh(1))
    assert shardings.layers[0].w_qkv.spec == P(None, TP_AXIS) and not report.replicated_uneven


def test_refusals():
    cfg, params = tiny_model(seed=1)
    with pytest.raises(ConfigError, match="tensor parallelism over 9 devices"):
        tp_mesh(9)

