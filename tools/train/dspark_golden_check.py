"""Checks tools/train/dspark.py (the DSpark draft pass used to train the mtp.* stages) against
the official reference's DSpark draft logits and confidences in the golden sets.

The golden run prefills P prompt tokens, decodes 8 greedy tokens and calls forward_spec after
each decode step. Here the prompt + generated tokens are run as one teacher-forced prefill
(v41.V41, "ref" numerics), main_hidden of every position feeds draft_forward, and the rows at the
8 decode positions (chain = the golden draft input + its 5 greedy drafts) are compared.

  python3 tools/train/dspark_golden_check.py [tests/data/golden/v41-tiny-a ...]

Exits 1 when a set's draft logits are outside 3x the golden envelope's rel_rms or their argmax
agrees on fewer than 95% of the draft rows.
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import dspark  # noqa: E402
import v41  # noqa: E402


def rel_rms(x, g):
    return float(np.sqrt(((x - g) ** 2).mean()) / np.sqrt((g ** 2).mean()))


def check(gdir):
    cfg = v41.Config.load(os.path.join(gdir, "config.json"))
    tensors = ckpt.read_safetensors(os.path.join(gdir, "model.safetensors"))
    model = v41.V41(cfg, ckpt.dequantized(tensors), numerics="ref")
    model.set_formats(tensors)
    man = json.load(open(os.path.join(gdir, "manifest.json")))
    ids = json.load(open(os.path.join(gdir, "prompt.json")))["prompt_ids"]
    gen = man["results"]["generated_ids"]
    outs = man["results"]["dspark_output_ids"]
    N = len(outs)
    P = len(ids)
    seq = ids + gen[:N]
    hash_ids = np.fromfile(os.path.join(gdir, "debug", "engram_hash_ids.bin"), np.int32)
    n_el = len(cfg.engram_layers)
    hash_ids = hash_ids.reshape(P + N, n_el, -1)
    rows = {lid: torch.from_numpy(hash_ids[None, :, i].astype(np.int64))
            for i, lid in enumerate(cfg.engram_layers)}
    NB = cfg.raw["text_config"]["dspark_block_size"]
    V = cfg.V
    g_logits = np.fromfile(os.path.join(gdir, "dspark_logits.bin"), np.float32).reshape(N, NB, V)
    g_conf = np.fromfile(os.path.join(gdir, "dspark_confidence.bin"), np.float32).reshape(N, NB)
    with torch.no_grad():
        _, hidden = model(torch.tensor([seq]), rows)
        chain = torch.zeros(1, P + N, NB, dtype=torch.long)
        for s in range(N):  # decode step s+1 processed position P+s
            chain[0, P + s] = torch.tensor(outs[s][:NB])
        logits, x, e = dspark.draft_forward(model, hidden, chain)
        conf = dspark.confidence(model, x, e)
    lg = logits[0, P:P + N].numpy()
    cf = conf[0, P:P + N].numpy()
    env = man["tolerance"]["envelope_valid_alternative_accumulation"]["free_running"]
    r_l, r_c = rel_rms(lg, g_logits), rel_rms(cf, g_conf)
    agree = float((lg.argmax(-1) == g_logits.argmax(-1)).mean())
    print(f"{os.path.basename(gdir)}: dspark logits rel_rms {r_l:.4f} (envelope "
          f"{env['dspark_logits.bin']['rel_rms']:.4f}) argmax_agree {agree:.3f}; confidence "
          f"rel_rms {r_c:.4f} (envelope {env['dspark_confidence.bin']['rel_rms']:.4f})")
    return r_l <= 3 * env["dspark_logits.bin"]["rel_rms"] and agree >= 0.95


def main():
    torch.set_num_threads(1)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    dirs = sys.argv[1:] or [os.path.join(root, "tests/data/golden", s)
                            for s in ("v41-tiny-a", "v41-tiny-c")]
    ok = all([check(d) for d in dirs])
    print("OK" if ok else "FAIL: outside the golden envelope")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
