"""Trains the DSpark stages (`mtp.*`) of the trained nano model on its frozen hidden states.

  python3 tools/train/train_dspark.py --model models/epd-nano --train WORK/train.ids \
      --greedy WORK/greedy.ids --out WORK/dspark --minutes 40 --seed 18

The main model (every tensor outside `mtp.*`, the shared embedding and LM head included) stays
frozen. Data, cached once by the frozen main model (v41 "train" numerics, no gradient):
  - `--greedy`: the main model's own greedy answers to training prompts (dspark_data.py, the C++
    engine); the last --heldout-greedy sequences are held out for the acceptance figures;
  - `--text-windows` random 128-token windows of the training ids.
Per window: main_hidden of every position (the DSpark input, v41 `hidden`) and the main model's
argmax at every position. For a draft position p the chain is x_{p+1} .. x_{p+5} (teacher
forcing: the chain the engine drafts when the earlier drafts were accepted) and the target of
draft i is the token the main model emits after x_{p+1+i}: the next token of a greedy sequence
(generated region), else the main model's argmax there. Loss: cross-entropy of the 5 draft
logits (markov bias included) + binary cross-entropy of the confidence head against "draft i is
the target" (the head's inputs detached, so it only calibrates). Weights fake-quantized as
exported (v41 "train" numerics); gate.bias by the aux-loss-free rule as train.py.

Writes OUT/state.pt (the mtp.* tensors) and OUT/log.jsonl (loss, held-out acceptance per draft
position: draft i counts where drafts 0..i-1 matched, i.e. the conditional acceptance the k
policy estimates).
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
import dspark  # noqa: E402
import v41  # noqa: E402

PAD = 2


def read_greedy(path):
    a = np.fromfile(path, dtype="<i4")
    out, k = [], 0
    while k < len(a):
        n = int(a[k])
        out.append(a[k + 1:k + 1 + n].astype(np.int64))
        k += 1 + n
    return out


def gen_start(seq, think_end=2043):
    te = np.nonzero(seq == think_end)[0]
    return int(te[0]) + 1 if len(te) else len(seq)


def cache(model, hasher, windows, seq, bs=8):
    """windows: list of (ids int64 [<= seq], gen_start or None). -> dict of tensors."""
    NB = model.cfg.raw["text_config"]["dspark_block_size"]
    hid, chain, target, valid = [], [], [], []
    with torch.no_grad():
        for k in range(0, len(windows), bs):
            part = windows[k:k + bs]
            x = np.full((len(part), seq), PAD, np.int64)
            for r, (w, _) in enumerate(part):
                x[r, :len(w)] = w[:seq]
            rows = {l: torch.from_numpy(v) for l, v in hasher.rows(x).items()}
            logits, hidden = model(torch.from_numpy(x), rows)
            am = logits.argmax(-1).numpy()  # [b, seq]: main token after position q
            for r, (w, gs) in enumerate(part):
                n = min(len(w), seq)
                ch = np.zeros((seq, NB), np.int64)
                tg = np.zeros((seq, NB), np.int64)
                vd = np.zeros((seq, NB), bool)
                for p in range(seq):
                    for i in range(NB):
                        q = p + 1 + i  # chain token position; target = token after q
                        if q >= n:
                            continue
                        ch[p, i] = w[q]
                        if gs is not None and q + 1 >= gs:
                            if q + 1 < n:
                                tg[p, i], vd[p, i] = w[q + 1], True
                        else:
                            tg[p, i], vd[p, i] = am[r, q], True
                hid.append(hidden[r].clone())
                chain.append(torch.from_numpy(ch))
                target.append(torch.from_numpy(tg))
                valid.append(torch.from_numpy(vd))
            if (k // bs) % 10 == 9 or k + bs >= len(windows):
                print(f"train_dspark: cached {min(k + bs, len(windows))}/{len(windows)} windows",
                      flush=True)
    return {"hidden": torch.stack(hid), "chain": torch.stack(chain),
            "target": torch.stack(target), "valid": torch.stack(valid)}


def pack(data, lengths, seq):
    """Packs short cached sequences (row r valid for lengths[r] positions) back to back into
    rows of `seq` positions with a segment id per position (-1: padding)."""
    rows, cur, used = [], [], 0
    for r, n in enumerate(lengths):
        n = min(int(n), data["hidden"].shape[1])
        if used + n > seq:
            rows.append(cur)
            cur, used = [], 0
        cur.append((r, n))
        used += n
    if cur:
        rows.append(cur)
    out = {k: [] for k in ("hidden", "chain", "target", "valid", "seg")}
    for row in rows:
        parts = {k: [] for k in out}
        for sid, (r, n) in enumerate(row):
            for k in ("hidden", "chain", "target", "valid"):
                parts[k].append(data[k][r, :n])
            parts["seg"].append(torch.full((n,), sid, dtype=torch.long))
        used = sum(n for _, n in row)
        for k in parts:
            t = torch.cat(parts[k])
            padv = -1 if k == "seg" else 0
            t = torch.cat([t, torch.full((seq - used,) + t.shape[1:], padv, dtype=t.dtype)])
            out[k].append(t)
    return {k: torch.stack(v) for k, v in out.items()}


def acceptance(model, data, bs=8):
    """Held-out per-position conditional acceptance of the greedy drafts (teacher-forced chain
    = the accepted prefix) and the mean sigmoid(confidence) there."""
    NB = data["chain"].shape[-1]
    drafted, accepted, conf = np.zeros(NB), np.zeros(NB), np.zeros(NB)
    with torch.no_grad():
        for k in range(0, data["hidden"].shape[0], bs):
            logits, x, e = dspark.draft_forward(model, data["hidden"][k:k + bs],
                                                data["chain"][k:k + bs], data["seg"][k:k + bs])
            cf = torch.sigmoid(dspark.confidence(model, x, e))
            ok = (logits.argmax(-1) == data["target"][k:k + bs])
            vd = data["valid"][k:k + bs]
            alive = vd[..., 0].clone()
            for i in range(NB):
                alive = alive & vd[..., i]
                drafted[i] += alive.sum().item()
                conf[i] += cf[..., i][alive].sum().item()
                alive = alive & ok[..., i]
                accepted[i] += alive.sum().item()
    return accepted / np.maximum(drafted, 1), conf / np.maximum(drafted, 1), drafted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the trained checkpoint (frozen main model)")
    ap.add_argument("--mtp-init", default=None,
                    help="checkpoint whose mtp.* tensors are the starting point (the pipeline's "
                         "random `epd gen-model` start; default --model)")
    ap.add_argument("--train", required=True)
    ap.add_argument("--greedy", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=40.0, help="training wall time (after caching)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--text-windows", type=int, default=320)
    ap.add_argument("--heldout-greedy", type=int, default=40)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--markov-init-scale", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()

    cfg = v41.Config.load(os.path.join(a.model, "config.json"))
    tensors = ckpt.read_safetensors(os.path.join(a.model, "model.safetensors"))
    weights = ckpt.dequantized(tensors)
    if a.mtp_init:
        init = ckpt.dequantized(ckpt.read_safetensors(os.path.join(a.mtp_init, "model.safetensors")))
        for name in weights:
            if name.startswith("mtp."):
                weights[name] = init[name]
    weights["mtp.2.markov_head.head.weight"] = (weights["mtp.2.markov_head.head.weight"]
                                                * a.markov_init_scale)
    model = v41.V41(cfg, weights, numerics="train")
    model.set_formats(tensors)
    model.freeze_quantized(keep=lambda name: name.startswith("mtp."))  # the frozen main model
    hasher = v41.EngramHasher(os.path.join(a.model, "engram_constants.json"))

    greedy = read_greedy(a.greedy)
    held_g, train_g = greedy[-a.heldout_greedy:], greedy[:-a.heldout_greedy]
    train_ids = np.fromfile(a.train, dtype="<i4").astype(np.int64)
    starts = rng.integers(0, len(train_ids) - a.seq - 1, size=a.text_windows)
    gseq = min(a.seq, -(-max(len(g) for g in greedy) // 16) * 16)
    held = cache(model, hasher, [(g, gen_start(g)) for g in held_g], gseq)
    held = pack(held, [len(g) for g in held_g], a.seq)
    gdata = cache(model, hasher, [(g, gen_start(g)) for g in train_g], gseq)
    gdata = pack(gdata, [len(g) for g in train_g], a.seq)
    tdata = cache(model, hasher, [(train_ids[s:s + a.seq], None) for s in starts], a.seq)
    tdata["seg"] = torch.zeros(tdata["chain"].shape[:2], dtype=torch.long)
    data = {k: torch.cat([gdata[k], tdata[k]]) for k in gdata}
    n_greedy = gdata["hidden"].shape[0]
    windows = data["hidden"]
    print(f"train_dspark: cached {len(windows)} training rows ({n_greedy} of packed greedy "
          f"sequences) and "
          f"{len(held_g)} held-out greedy sequences in {(time.time() - t_start) / 60:.1f} min",
          flush=True)

    params = []
    for name, key in model.names.items():
        p = model.params[key]
        if name.startswith("mtp.") and "gate.bias" not in name:
            params.append(p)
        else:
            p.requires_grad_(False)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    biases = {name[:-len("gate.bias")]: model.params[key] for name, key in model.names.items()
              if name.startswith("mtp.") and name.endswith("ffn.gate.bias")}
    log = open(os.path.join(a.out, "log.jsonl"), "a")

    def evaluate(step):
        acc, conf, drafted = acceptance(model, held)
        rec = {"step": step, "heldout_accept": [round(v, 4) for v in acc],
               "heldout_mean_sigmoid_conf": [round(v, 4) for v in conf],
               "heldout_drafted": [int(v) for v in drafted],
               "min": round((time.time() - t0) / 60, 2)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(f"train_dspark: {rec}", flush=True)

    def save():
        sd = {name: model.params[key].detach().clone() for name, key in model.names.items()
              if name.startswith("mtp.")}
        torch.save({"params": sd, "step": step, "args": vars(a)}, os.path.join(a.out, "state.pt"))

    t0 = time.time()
    step = 0
    evaluate(0)
    budget = a.minutes * 60.0
    N = data["hidden"].shape[0]
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (a.max_steps and step >= a.max_steps):
            break
        progress = elapsed / budget
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        # half greedy windows, half text windows
        half = a.batch // 2
        pick = np.concatenate([rng.integers(0, n_greedy, size=half),
                               rng.integers(n_greedy, N, size=a.batch - half)])
        pick = torch.from_numpy(pick)
        stats = []
        model.dspark_stats = stats
        logits, x, e = dspark.draft_forward(model, data["hidden"][pick], data["chain"][pick],
                                            data["seg"][pick])
        model.dspark_stats = None
        vd = data["valid"][pick]
        tg = data["target"][pick]
        ce = F.cross_entropy(logits[vd], tg[vd])
        ok = (logits.argmax(-1) == tg).float()
        cf = dspark.confidence(model, x.detach(), e.detach())
        bce = F.binary_cross_entropy_with_logits(cf[vd], ok[vd])
        loss = ce + bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            for pre, load in stats:
                b = biases.get(pre)
                if b is not None:
                    b.add_(1e-3 * torch.sign(load.mean() - load))
        step += 1
        if step % 10 == 0:
            rec = {"step": step, "ce": round(ce.item(), 4), "bce": round(bce.item(), 4),
                   "train_top1": round(ok[vd].mean().item(), 4), "lr": lr,
                   "min": round((time.time() - t0) / 60, 2)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"train_dspark: {rec}", flush=True)
        if step % a.eval_every == 0:
            evaluate(step)
            save()
    save()
    evaluate(step)


if __name__ == "__main__":
    main()
