"""Reference logits of an exported checkpoint from the PyTorch module (numerics "ref").

  python3 tools/train/parity.py --model models/epd-nano --ids WORK/heldout.ids \
      --out tests/data/trained_nano_parity

Takes prompts from the held-out ids (windows of several lengths, each starting at a BOS so they
look like served requests), computes the last-position logits of a one-shot prefill, and writes
OUT/prompts.json ({"prompts": [[ids...], ...], "route_margins": [...]}) and OUT/logits.bin
(float32 [n, vocab]). The C++ test tests/model/trained_nano_test.cc prefills the same prompts
through model::Model and compares, so the parity check runs without torch.

Routing near-ties. The MoE picks each token's top-k experts by score; where the k-th and the
(k+1)-th scores differ by less than the two implementations' arithmetic difference (bf16
rounding in different orders, ~1e-3), either choice is a correct evaluation of the reference,
and the two implementations may pick differently; one such flip at the last position moves the
compared logits well outside the golden envelope (docs/demo.md "Parity"). So each prompt is the
first window, in a fixed order of held-out BOS positions, whose every routing decision at the
last position clears --margin; the least margins at the last and at earlier positions are
written beside it. (Earlier positions reach the last one only through attention; their flips,
unavoidable among a few thousand decisions, move the compared logits far less.)
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
    ref = Reference(model_dir)
    return np.stack([ref.logits(p)[0] for p in prompts]).astype(np.float32)


class Reference:
    def __init__(self, model_dir):
        cfg = v41.Config.load(os.path.join(model_dir, "config.json"))
        tensors = ckpt.read_safetensors(os.path.join(model_dir, "model.safetensors"))
        self.model = v41.V41(cfg, ckpt.dequantized(tensors), numerics="ref")
        self.model.set_formats(tensors)
        self.hasher = v41.EngramHasher(os.path.join(model_dir, "engram_constants.json"))

    def logits(self, prompt):
        """(last-position logits, min routing margin at the last position, min elsewhere)."""
        x = np.array([prompt], np.int64)
        rows = {l: torch.from_numpy(r) for l, r in self.hasher.rows(x).items()}
        self.model.route_margins = []
        with torch.no_grad():
            logits, _ = self.model(torch.from_numpy(x), rows)
        m = torch.stack([g[0] for _, g in self.model.route_margins])  # [layers, S]
        self.model.route_margins = None
        earlier = float(m[:, :-1].min()) if m.shape[1] > 1 else float("inf")
        return logits[0, -1].numpy(), float(m[:, -1].min()), earlier


def main():
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--margin", type=float, default=0.01,
                    help="least routing-score gap at the last position")
    ap.add_argument("--tries", type=int, default=64, help="windows tried per length")
    a = ap.parse_args()
    ids = np.fromfile(a.ids, dtype="<i4").astype(np.int64)
    bos = np.nonzero(ids == 0)[0]
    ref = Reference(a.model)
    prompts, logits, margins = [], [], []
    for k, n in enumerate(LENGTHS):
        for t in range(a.tries):
            start = int(bos[(7 * k + 3 + 13 * t) % len(bos)])
            p = [int(v) for v in ids[start:start + n]]
            if len(p) < n:
                continue
            lg, last, earlier = ref.logits(p)
            if last >= a.margin:
                break
        else:
            sys.exit(f"parity: no {n}-token window clear of routing near-ties in {a.tries} tries")
        print(f"parity: {n} tokens, try {t}: routing margin {last:.4f} last, {earlier:.4f} earlier")
        prompts.append(p)
        logits.append(lg)
        margins.append({"last": round(last, 6), "earlier": round(earlier, 6)})
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "prompts.json"), "w") as f:
        json.dump({"prompts": prompts, "route_margins": margins}, f)
        f.write("\n")
    np.stack(logits).astype(np.float32).tofile(os.path.join(a.out, "logits.bin"))
    print(f"parity: {len(prompts)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
