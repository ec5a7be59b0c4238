#!/usr/bin/env bash
# On the lent GPU, after `device_setup.sh build` (same warm machine): one part of a bench run.
#   bash benchmarks/bench_device.sh CONFIG FINISH_BY_S          first part -> $OUT/bench
#   bash benchmarks/bench_device.sh CONFIG FINISH_BY_S resume   the units the last part skipped
#                                                              or cut off, joined with it -> $OUT/bench
# The bench is killed at FINISH_BY_S + 100 s (HARD_S overrides), inside a call's 600 s, so that its
# bench.json (written after every row) still reaches /tmp/prev for the next part.
# Each part keeps a copy of its bench.json in /tmp/prev for the next part, and its compiled programs
# in /tmp/jax_cache, so a resumed part loads the decoders the first one compiled (docs/results.md).
set -euo pipefail
config=$1 finish_by=$2
export PYTHONPATH=/tmp/site:$PWD
export SPECJAX_COMMIT=${SPECJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
resume=()
if [ "${3:-}" = resume ]; then resume=(--resume /tmp/prev/bench.json); fi
mkdir -p "$OUT/bench" /tmp/prev
timeout --signal=KILL "${HARD_S:-$((finish_by + 100))}" \
  python -u -c "import sys; from specjax.cli import main; sys.exit(main(sys.argv[1:]))" bench "$config" \
  --prompts-from /tmp/stash/prompts_h200.json --finish-by-s "$finish_by" "${resume[@]}" --out "$OUT/bench" \
  --compile-cache /tmp/jax_cache \
  2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/bench/bench.log" || echo "bench stopped: $?"
cp "$OUT/bench/bench.json" /tmp/prev/bench.json
