#!/usr/bin/env bash
# The whole demo-model pipeline in one command (tools/train/README.md, docs/demo.md):
# data -> tokenizer -> random starting checkpoint -> training -> export -> parity references.
#
#   bash tools/train/run_all.sh [--minutes 55] [--seed 18] [--out models/epd-nano]
#
# Needs: a built ./build/epd (bash deploy/build.sh) and, not part of CI,
#   apt-get install -y --no-install-recommends python3-torch python3-numpy libopenblas0-pthread \
#       python3.11-doc debian-reference-en
# (libopenblas0-pthread replaces Debian's reference BLAS under torch: ~10x faster matmuls.)
# Runs one thread at the lowest priority. Work files go to tools/train/work/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
MINUTES=55
SEED=18
OUT=models/epd-nano
while [[ $# -gt 0 ]]; do
  case "$1" in
    --minutes) MINUTES="$2"; shift 2 ;;
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
# 2. Tokenizer (the project's BPE trainer, model/bpe_trainer.cc) + random starting checkpoint.
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
# 5. Parity references (torch logits of the exported checkpoint) + the test dictionary.
nice -n 19 "$PY" tools/train/parity.py --model "$OUT" --ids "$W/heldout.ids" \
  --out tests/data/trained_nano_parity
cp "$W/words.txt" tests/data/trained_nano_parity/words.txt
cp "$W/heldout_plain.txt" tests/data/trained_nano_parity/heldout.txt
sha256sum "$OUT/model.safetensors"
