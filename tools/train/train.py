"""Trains the nano V4.1 demo model on CPU (issue 18). One thread, bounded by wall time.

  python3 tools/train/train.py --init WORK/init --train WORK/train.ids --heldout WORK/heldout.ids \
      --out WORK/run --minutes 55 --seed 18

--init is an `epd gen-model --tokenizer-corpus` directory: its random checkpoint is the starting
point and fixes every tensor name, shape and storage format. Trained: all main-model tensors that
receive a gradient (embedding, head, norms, attention, compressors, mHC, MoE experts and gates,
Engram). Not trained: the indexer (its top-k selection has no gradient; its random projections
still pick the compressed entries, as they will at serving time), gate.bias (set by the
auxiliary-loss-free balancing rule instead: +/- 1e-3 per step towards equal expert load),
gate.bias_vl (vision only) and the DSpark stages mtp.* (kept as initialised).

Sequences are random windows of --seq tokens from the training ids (the chat samples one after
another), drawn from a seeded generator; loss is next-token cross-entropy on every position.
Weights and KV are fake-quantized (v41.py "train" numerics) so the FP8/FP4 export computes what
was trained. Writes OUT/state.pt at every checkpoint interval and at the end, and OUT/log.jsonl.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import v41  # noqa: E402


def load_ids(path):
    return np.fromfile(path, dtype="<i4").astype(np.int64)


def batch_at(ids, starts, seq):
    x = np.stack([ids[s:s + seq] for s in starts])
    y = np.stack([ids[s + 1:s + seq + 1] for s in starts])
    return x, y


THINK_END_ID = 2043  # </think> in the nano tokenizer: the assistant's answer starts after it


def title_weights(x, weight, tokens):
    """[B, S] loss weights: `weight` at the positions whose target is one of the first `tokens`
    tokens after a </think> (the answer's opening words), 1 elsewhere."""
    w = np.ones(x.shape, dtype=np.float32)
    for b, p in zip(*np.nonzero(x == THINK_END_ID)):
        w[b, p:p + tokens] = weight
    return w


def weighted_loss(logits, y, w):
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1),
                         reduction="none")
    wt = torch.from_numpy(w).reshape(-1)
    return (ce * wt).sum() / wt.sum()


def evaluate(model, hasher, ids, seq, max_windows=24):
    """Mean next-token loss over consecutive non-overlapping windows of the held-out ids."""
    n = min(max_windows, (len(ids) - 1) // seq)
    starts = [i * seq for i in range(n)]
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for k in range(0, n, 4):
            x, y = batch_at(ids, starts[k:k + 4], seq)
            rows = {l: torch.from_numpy(r) for l, r in hasher.rows(x).items()}
            logits, _ = model(torch.from_numpy(x), rows)
            tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   torch.from_numpy(y).reshape(-1), reduction="sum").item()
            cnt += y.size
    return tot / max(cnt, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=55.0)
    ap.add_argument("--max-steps", type=int, default=0, help="0 = until --minutes")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--save-every-min", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--title-weight", type=float, default=1.0,
                    help="loss weight of the first --title-tokens targets after each </think> "
                         "(the start of an answer: its topic in the titled samples); 1 = plain")
    ap.add_argument("--title-tokens", type=int, default=4)
    ap.add_argument("--head-init-scale", type=float, default=0.2,
                    help="scales the random LM head first (gen-model's gain 3 is overconfident)")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)

    cfg = v41.Config.load(os.path.join(a.init, "config.json"))
    tensors = ckpt.read_safetensors(os.path.join(a.init, "model.safetensors"))
    weights = ckpt.dequantized(tensors)
    weights["head.weight"] = weights["head.weight"] * a.head_init_scale
    model = v41.V41(cfg, weights, numerics="train")
    model.set_formats(tensors)
    hasher = v41.EngramHasher(os.path.join(a.init, "engram_constants.json"))
    train_ids, held_ids = load_ids(a.train), load_ids(a.heldout)

    frozen = ("indexer.", "gate.bias", "mtp.")
    params = []
    for name, key in model.names.items():
        p = model.params[key]
        if any(f in name for f in frozen):
            p.requires_grad_(False)
        else:
            params.append(p)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    biases = {name[:-len("gate.bias")]: model.params[key] for name, key in model.names.items()
              if name.endswith("ffn.gate.bias") and not name.startswith("mtp.")}

    log = open(os.path.join(a.out, "log.jsonl"), "a")
    budget = a.minutes * 60.0
    t0 = time.time()
    last_save = t0
    step = 0
    n_params = sum(p.numel() for p in params)
    print(f"train: {n_params / 1e6:.2f}M trained parameters, {len(train_ids)} train tokens, "
          f"{len(held_ids)} held-out tokens", flush=True)

    def save(tag):
        sd = {name: model.params[key].detach().clone() for name, key in model.names.items()}
        torch.save({"params": sd, "step": step, "args": vars(a)}, os.path.join(a.out, "state.pt"))
        print(f"train: saved state at step {step} ({tag})", flush=True)

    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (a.max_steps and step >= a.max_steps):
            break
        progress = elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_ids) - a.seq - 1, size=a.batch)
        x, y = batch_at(train_ids, starts, a.seq)
        rows = {l: torch.from_numpy(r) for l, r in hasher.rows(x).items()}
        stats = []
        logits, _ = model(torch.from_numpy(x), rows, stats=stats)
        if a.title_weight == 1.0:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   torch.from_numpy(y).reshape(-1))
        else:
            loss = weighted_loss(logits, y, title_weights(x, a.title_weight, a.title_tokens))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing (DeepSeek-V3 rule)
            for pre, load in stats:
                b = biases.get(pre)
                if b is not None:
                    b.add_(1e-3 * torch.sign(load.mean() - load))
        step += 1
        if step % 10 == 0:
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr,
                   "min": round((time.time() - t0) / 60, 2)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"train: {rec}", flush=True)
        if time.time() - last_save > a.save_every_min * 60:
            save("interval")
            last_save = time.time()
    save("final")
    held = evaluate(model, hasher, held_ids, a.seq)
    rec = {"step": step, "heldout_loss": round(held, 4), "heldout_ppl": round(math.exp(held), 2),
           "min": round((time.time() - t0) / 60, 2)}
    log.write(json.dumps(rec) + "\n")
    print(f"train: {rec}", flush=True)


if __name__ == "__main__":
    main()
