"""Lower the GPU kernels for CUDA on a machine without a GPU, to catch Pallas lowering errors
before spending device time. Needs the device's JAX (0.11.2) with its CUDA plugin installed
(`pip install jax==0.11.2 jax-cuda13-plugin==0.11.2` in a Python 3.12 venv); nothing runs, the
Triton and Mosaic GPU compilers proper only run on the device.

    JAX_PLATFORMS=cpu python benchmarks/lower_check.py
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import AxisType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

S = jax.ShapeDtypeStruct
BF16, I32 = jnp.bfloat16, jnp.int32


def cases():
    from pallas_kernels.decode_attention import decode_attention
    from pallas_kernels.paged_attention import paged_attention
    import mosaic_gemm_prototype as mp
    yield "decode_attention", decode_attention, (S((1, 16, 32, 128), BF16), S((1, 1024, 8, 128), BF16),
                                                 S((1, 1024, 8, 128), BF16), S((1, 16, 1024), bool), S((1,), I32))
    yield "paged_attention", paged_attention, (S((32, 9, 32, 128), BF16), S((2049, 16, 8, 128), BF16),
                                               S((2049, 16, 8, 128), BF16), S((32, 64), I32), S((32, 9), I32),
                                               S((32,), I32))
    w, x = S((28672, 8192), BF16), S((16, 8192), BF16)
    lo, code = S((28672, 8192), jnp.uint8), S((28672, 8192), jnp.int4)
    yield "mosaic ws bf16", lambda w, x: mp.gemm_ws_bf16(w, x, splits=4), (w, x)
    yield "mosaic stream bf16", lambda w, x: mp.gemm_stream_bf16(w, x, splits=4), (w, x)
    yield "mosaic stream 12-bit", lambda lo, c, x: mp.gemm_stream_12(lo, c, 60, x, splits=4), (lo, code, x)


def main() -> int:
    dev = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    failed = 0
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,), abstract_device=dev)):
        for name, fn, args in cases():
            try:
                jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
                print(f"ok    {name}")
            except Exception as e:  # noqa: BLE001 - every failure is reported, the rest still run
                failed += 1
                print(f"FAIL  {name}: {e!r}"[:800])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
