"""Reference logits of an exported checkpoint from the PyTorch module (numerics "ref").

  python3 tools/train/parity.py --model models/epd-nano --ids WORK/heldout.ids \
      --out tests/data/trained_nano_parity

Takes prompts from the held-out ids (windows of several lengths, each starting at a BOS so they
look like served requests), computes the last-position logits of a one-shot prefill, and writes
OUT/prompts.json ({"prompts": [[ids...], ...]}) and OUT/logits.bin (float32 [n, vocab]). The C++
test tests/model/trained_nano_test.cc prefills the same prompts through model::Model and
compares, so the parity check runs without torch.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import v41  # noqa: E402

LENGTHS = (9, 40, 130, 300)


def reference_logits(model_dir, prompts):
    cfg = v41.Config.load(os.path.join(model_dir, "config.json"))
    tensors = ckpt.read_safetensors(os.path.join(model_dir, "model.safetensors"))
    model = v41.V41(cfg, ckpt.dequantized(tensors), numerics="ref")
    model.set_formats(tensors)
    hasher = v41.EngramHasher(os.path.join(model_dir, "engram_constants.json"))
    out = []
    with torch.no_grad():
        for p in prompts:
            x = np.array([p], np.int64)
            rows = {l: torch.from_numpy(r) for l, r in hasher.rows(x).items()}
            logits, _ = model(torch.from_numpy(x), rows)
            out.append(logits[0, -1].numpy())
    return np.stack(out).astype(np.float32)


def main():
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ids = np.fromfile(a.ids, dtype="<i4").astype(np.int64)
    bos = np.nonzero(ids == 0)[0]
    prompts = []
    for k, n in enumerate(LENGTHS):
        start = int(bos[(7 * k + 3) % len(bos)])
        prompts.append([int(t) for t in ids[start:start + n]])
    logits = reference_logits(a.model, prompts)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "prompts.json"), "w") as f:
        json.dump({"prompts": prompts}, f)
        f.write("\n")
    logits.tofile(os.path.join(a.out, "logits.bin"))
    print(f"parity: {len(prompts)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
