"""Greedy continuations of the trained main model, the DSpark heads' self-distillation data.

The DSpark drafts are accepted when they equal the main model's own greedy tokens, so the heads
are trained on text the main model writes itself (plus the training text, train_dspark.py). For
--n chat samples drawn with the seed from the training ids, the prompt (BOS .. </think>) is
answered by `epd generate --monolithic` (greedy, the C++ engine that serves the checkpoint) for
up to --max-tokens tokens; each prompt + answer is written as one sequence.

  python3 tools/train/dspark_data.py --epd build/epd --model models/epd-nano \
      --train WORK/train.ids --out WORK/greedy.ids --n 400 --max-tokens 96 --seed 18

Output: int32 little-endian, each sequence prefixed by its length (one int32).
"""

import argparse
import json
import os
import subprocess
import tempfile

import numpy as np

THINK_END = 2043  # </think> in the nano tokenizer (tokenizer.json's added tokens)
BOS = 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epd", default="build/epd")
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=18)
    a = ap.parse_args()
    ids = np.fromfile(a.train, dtype="<i4")
    starts = np.nonzero(ids == BOS)[0]
    rng = np.random.default_rng(a.seed)
    pick = np.sort(rng.choice(len(starts) - 1, size=min(a.n, len(starts) - 1), replace=False))
    out = []
    with tempfile.TemporaryDirectory() as td:
        pj = os.path.join(td, "prompt.json")
        for k, si in enumerate(pick):
            s, e = starts[si], starts[si + 1]
            sample = ids[s:e]
            te = np.nonzero(sample == THINK_END)[0]
            if len(te) == 0:
                continue
            prompt = [int(t) for t in sample[:te[0] + 1]]
            with open(pj, "w") as f:
                json.dump(prompt, f)
            r = subprocess.run([a.epd, "generate", "--model", a.model, "--prompt-ids", pj,
                                "--max-tokens", str(a.max_tokens), "--monolithic"],
                               capture_output=True, text=True, check=True)
            line = [l for l in r.stdout.splitlines() if l.startswith("{")][-1]
            gen = json.loads(line)["ids"]
            seq = prompt + gen
            out.append(np.array([len(seq)] + seq, np.int32))
            if (k + 1) % 50 == 0:
                print(f"dspark_data: {k + 1}/{len(pick)} sequences", flush=True)
    np.concatenate(out).astype("<i4").tofile(a.out)
    print(f"dspark_data: {len(out)} sequences, {sum(len(o) - 1 for o in out)} tokens -> {a.out}")


if __name__ == "__main__":
    main()
