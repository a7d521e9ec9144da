#!/usr/bin/env bash
# The whole demo-model pipeline in one command (tools/train/README.md, docs/demo.md):
# data -> tokenizer -> random starting checkpoint -> training -> export -> continued training from
# the export, then on answers that start with their topic ("titled") -> export -> parity
# references -> DSpark stages (greedy answers of the trained model, heads trained on its frozen hidden states,
# exported into the same checkpoint with the main weights copied byte for byte).
#
#   bash tools/train/run_all.sh [--minutes 52] [--more-minutes 30] [--titled-minutes 50]
#       [--dspark-minutes 40] [--seed 18] [--out models/epd-nano]
#   bash tools/train/run_all.sh --dspark-only [--dspark-minutes 40] [--seed 18]  # step 6 alone, on OUT
#
# Needs: a built ./build/epd (bash deploy/build.sh) and, not part of CI,
#   apt-get install -y --no-install-recommends python3-torch python3-numpy libopenblas0-pthread \
#       python3.11-doc debian-reference-en
# (libopenblas0-pthread replaces Debian's reference BLAS under torch: ~10x faster matmuls.)
# Runs one thread at the lowest priority. Work files go to tools/train/work/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
MINUTES=52
MORE_MINUTES=30
TITLED_MINUTES=50
DSPARK_MINUTES=40
DSPARK_ONLY=0
SEED=18
OUT=models/epd-nano
while [[ $# -gt 0 ]]; do
  case "$1" in
    --minutes) MINUTES="$2"; shift 2 ;;
    --more-minutes) MORE_MINUTES="$2"; shift 2 ;;
    --titled-minutes) TITLED_MINUTES="$2"; shift 2 ;;
    --dspark-minutes) DSPARK_MINUTES="$2"; shift 2 ;;
    --dspark-only) DSPARK_ONLY=1; shift ;;
    --seed) SEED="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "run_all.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=/usr/bin/python3
W=tools/train/work
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
mkdir -p "$W"
[[ -x build/epd ]] || { echo "run_all.sh: build epd first (bash deploy/build.sh)" >&2; exit 1; }

# 1. Data: Debian-packaged documentation -> chat samples, fixed split (seeded).
nice -n 19 "$PY" tools/train/prep_data.py --out "$W" --seed "$SEED"
# The same samples with each answer starting "<topic as the question spells it>: " (step 4c).
nice -n 19 "$PY" tools/train/prep_data.py --out "$W/titled" --seed "$SEED" --titled
if [[ "$DSPARK_ONLY" == 0 ]]; then
# 2. Tokenizer (the project's BPE trainer, tokenizer/bpe_trainer.cc) + random starting checkpoint.
rm -rf "$W/init"
nice -n 19 ./build/epd gen-model --out "$W/init" --tokenizer-corpus "$W/tokenizer_corpus.txt" \
  --seed "$SEED"
for f in train heldout; do
  nice -n 19 ./build/epd tokenize --model "$W/init" --in "$W/$f.txt" --out "$W/$f.ids"
done
# 3. Training (bounded by wall time, one thread).
rm -rf "$W/run"
nice -n 19 "$PY" tools/train/train.py --init "$W/init" --train "$W/train.ids" \
  --heldout "$W/heldout.ids" --out "$W/run" --minutes "$MINUTES" --seed "$SEED" \
  --batch 8 --seq 128 --lr 3e-3 --warmup 30
# 4. Export to the released checkpoint format.
nice -n 19 "$PY" tools/train/export.py --init "$W/init" --state "$W/run/state.pt" --out "$OUT"
# 4b. Continued training, started from that export (its FP8/FP4 weights dequantized; the LM head
# as exported), new window draws (seed + 1), a fresh warm-up and cosine schedule; exported again.
# 4c. The same on the titled samples (seed + 2): the answer's first tokens copy the question's
# topic, which teaches the model to use the question; the loss weighs those first 4 answer tokens
# 4x (docs/demo.md has the committed run's exact history). 0 minutes skips a step.
if [[ "$MORE_MINUTES" != 0 ]]; then
  rm -rf "$W/run2"
  nice -n 19 "$PY" tools/train/train.py --init "$OUT" --head-init-scale 1.0 --train "$W/train.ids" \
    --heldout "$W/heldout.ids" --out "$W/run2" --minutes "$MORE_MINUTES" --seed "$((SEED + 1))" \
    --batch 8 --seq 128 --lr 2e-3 --warmup 10
  nice -n 19 "$PY" tools/train/export.py --init "$OUT" --state "$W/run2/state.pt" --out "$OUT"
fi
if [[ "$TITLED_MINUTES" != 0 ]]; then
  for f in train heldout; do
    nice -n 19 ./build/epd tokenize --model "$OUT" --in "$W/titled/$f.txt" --out "$W/titled/$f.ids"
  done
  rm -rf "$W/run3"
  nice -n 19 "$PY" tools/train/train.py --init "$OUT" --head-init-scale 1.0 \
    --train "$W/titled/train.ids" --heldout "$W/titled/heldout.ids" --out "$W/run3" \
    --minutes "$TITLED_MINUTES" --seed "$((SEED + 2))" --batch 8 --seq 128 --lr 1.5e-3 --warmup 10 \
    --title-weight 4
  nice -n 19 "$PY" tools/train/export.py --init "$OUT" --state "$W/run3/state.pt" --out "$OUT"
fi
# 5. Parity references (torch logits of the exported checkpoint) + the test dictionary.
nice -n 19 "$PY" tools/train/parity.py --model "$OUT" --ids "$W/heldout.ids" \
  --out tests/data/trained_nano_parity
cp "$W/words.txt" tests/data/trained_nano_parity/words.txt
cp "$W/heldout_plain.txt" tests/data/trained_nano_parity/heldout.txt
else
  if [[ ! -f "$W/init/model.safetensors" ]]; then  # the random start of the DSpark stages
    nice -n 19 ./build/epd gen-model --out "$W/init" --tokenizer-corpus "$W/tokenizer_corpus.txt" \
      --seed "$SEED"
  fi
fi
# 6. DSpark stages (mtp.*): the trained model's own greedy answers to 400 training prompts (the
# C++ engine), the heads trained on the frozen main model's hidden states (train_dspark.py), then
# exported into OUT: only mtp.* tensors change, every main tensor is copied byte for byte. The
# prompts and text windows come from the titled samples (the format the main model ended on).
nice -n 19 ./build/epd tokenize --model "$OUT" --in "$W/titled/train.txt" --out "$W/titled/train.ids"
nice -n 19 "$PY" tools/train/dspark_data.py --epd ./build/epd --model "$OUT" \
  --train "$W/titled/train.ids" --out "$W/greedy.ids" --n 400 --max-tokens 96 --seed "$SEED"
rm -rf "$W/dspark"
nice -n 19 "$PY" tools/train/train_dspark.py --model "$OUT" --train "$W/titled/train.ids" \
  --greedy "$W/greedy.ids" --mtp-init "$W/init" --out "$W/dspark" --minutes "$DSPARK_MINUTES" \
  --seed "$SEED"
nice -n 19 "$PY" tools/train/export.py --init "$OUT" --state "$W/dspark/state.pt" --out "$OUT" \
  --only-prefix mtp.
sha256sum "$OUT/model.safetensors"
