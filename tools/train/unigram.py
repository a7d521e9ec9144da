"""Unigram baseline for `epd eval` (docs/demo.md): token frequencies of the training ids
(add-one smoothing over the vocabulary), scored on exactly the positions `epd eval` scores
(windows of --context + --score tokens; the --score tokens after each prompt).

  python3 tools/train/unigram.py --train WORK/train.ids --data-ids HELDOUT.ids \
      --vocab 2048 --context 1024 --score 64 --windows 4
"""

import argparse
import json
import math

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--data-ids", required=True, help="`epd tokenize` output of the --data file")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--score", type=int, default=64)
    ap.add_argument("--windows", type=int, default=4)
    a = ap.parse_args()
    train = np.fromfile(a.train, dtype="<i4")
    data = np.fromfile(a.data_ids, dtype="<i4")
    counts = np.bincount(train, minlength=a.vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    span = a.context + a.score
    n = min(a.windows, len(data) // span)
    scored = np.concatenate([data[w * span + a.context:(w + 1) * span] for w in range(n)])
    nll = float(-logp[scored].mean())
    print(json.dumps({"baseline": "unigram", "context": a.context, "score": a.score, "windows": n,
                      "scored_tokens": int(scored.size), "mean_nll": nll,
                      "perplexity": math.exp(nll)}))


if __name__ == "__main__":
    main()
