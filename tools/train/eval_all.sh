#!/usr/bin/env bash
# The perplexity table of docs/demo.md: `epd eval` on the held-out text at 1K-8K contexts, exact
# vs bounded decoder replay, FP4 vs unquantized compressed KV, and the unigram baseline on the
# same scored positions (needs tools/train/work/train.ids from run_all.sh for the baseline).
#   bash tools/train/eval_all.sh [MODEL_DIR] > eval.jsonl
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="${1:-models/epd-nano}"
DATA=tests/data/trained_nano_parity/heldout.txt
W=tools/train/work
./build/epd tokenize --model "$MODEL" --in "$DATA" --out "$W/heldout_plain.ids" >&2
for ctx in 1024 2048 4096 8192; do
  for replay in exact bounded; do
    for kv in full fp4; do
      nice -n 19 ./build/epd eval --model "$MODEL" --data "$DATA" --context "$ctx" --score 64 \
        --windows 4 --replay "$replay" --kv "$kv" 2>/dev/null | tail -n 1
    done
  done
  if [[ -f "$W/train.ids" ]]; then
    /usr/bin/python3 tools/train/unigram.py --train "$W/train.ids" --data-ids "$W/heldout_plain.ids" \
      --context "$ctx" --score 64 --windows 4
  fi
done
