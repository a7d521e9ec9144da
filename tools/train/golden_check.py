"""Checks the PyTorch V4.1 module against the golden reference logits (tests/data/golden).

The golden sets hold logits computed by the official inference code on tiny random checkpoints;
agreement within the golden envelope shows that tools/train/v41.py is the real architecture.

  python3 tools/train/golden_check.py [tests/data/golden/v41-tiny-a ...]   (default: every set)

Prints rel_rms / argmax agreement per set and mode; exits 1 when the "ref" mode falls outside
the envelope (rel_rms <= 2x the valid-alternative-accumulation figure, argmax agreement >= 0.9).
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import v41  # noqa: E402


def compare(x, g):
    d = x - g
    rel = float(np.sqrt((d ** 2).mean()) / np.sqrt((g ** 2).mean()))
    agree = float((x.argmax(-1) == g.argmax(-1)).mean())
    return rel, agree, float(np.abs(d).max())


def check(gdir, modes=("ref", "fp32")):
    cfg = v41.Config.load(os.path.join(gdir, "config.json"))
    tensors = ckpt.read_safetensors(os.path.join(gdir, "model.safetensors"))
    weights = ckpt.dequantized(tensors)
    ids = json.load(open(os.path.join(gdir, "prompt.json")))["prompt_ids"]
    P = len(ids)
    hash_ids = np.fromfile(os.path.join(gdir, "debug", "engram_hash_ids.bin"), np.int32)
    n_el = len(cfg.engram_layers)
    hash_ids = hash_ids.reshape(-1, n_el, hash_ids.size // (P + 8) // n_el)[:P]
    rows = {lid: torch.from_numpy(hash_ids[None, :, i].astype(np.int64))
            for i, lid in enumerate(cfg.engram_layers)}
    golden = np.fromfile(os.path.join(gdir, "logits_prefill_all.bin"), np.float32).reshape(P, -1)
    manifest = json.load(open(os.path.join(gdir, "manifest.json")))
    env = manifest["tolerance"]["envelope_valid_alternative_accumulation"]["free_running"][
        "logits_prefill_all.bin"]
    ok = True
    for mode in modes:
        model = v41.V41(cfg, weights, numerics=mode)
        model.set_formats(tensors)
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]), rows)
        rel, agree, mx = compare(logits[0].numpy(), golden)
        print(f"{os.path.basename(gdir)} {mode:5s}: rel_rms {rel:.4f} (envelope {env['rel_rms']:.4f})"
              f" argmax_agree {agree:.4f} (envelope {env['argmax_agree']:.4f}) max_abs {mx:.3f}")
        if mode == "ref" and (rel > 2 * env["rel_rms"] or agree < 0.9):
            ok = False
    return ok


def main():
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    gd = os.path.join(root, "tests/data/golden")
    dirs = sys.argv[1:] or sorted(os.path.join(gd, s) for s in os.listdir(gd)
                                  if os.path.exists(os.path.join(gd, s, "model.safetensors")))
    ok = all([check(d) for d in dirs])
    print("OK" if ok else "FAIL: outside the golden envelope")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
