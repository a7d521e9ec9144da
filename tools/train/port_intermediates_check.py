"""Checks the PyTorch port's "ref" numerics (v41.py) against the official reference's
intermediates of every golden set in tests/data/golden (debug/*), not only its logits (issue 55).

  /usr/bin/python3 tools/train/port_intermediates_check.py [--sets-dir DIR] [SET_DIR ...]

Two comparisons per set (rel_rms = sqrt(mean((x - g)^2)) / sqrt(mean(g^2)) over the file):

  module  module teacher forcing: every module gets the golden input from debug/ (attention
          layers in order, so the source layers build the shared compressed KV, index keys,
          top-k and candidates from golden inputs): Engram (rel_rms of what it adds), attention,
          MoE, and the LM head on the golden final norm. This isolates each module's own
          arithmetic; the reference's summation orders make it tight.
  free    the free-running prefill: attn_in / attn_out / ffn_in / ffn_out per layer, Engram
          in/out, final norm and logits. A 1-ulp difference anywhere is re-quantized and grows
          through the layers, so this is bounded by the sets' measured envelope of a valid
          different accumulation order (manifest.json -> tolerance), not by module precision.

Exits 1 when a figure is outside its bound (the LIMITS below; see the comments there for where
each comes from), 77 when torch is not importable (ctest: skipped). --exact demands bit-exactness
of every compared file (what this machine gives: Debian torch 1.13.1, AVX2 kernels).
"""

import argparse
import json
import os
import sys
import time

try:
    import numpy as np
    import torch
except ImportError:
    print("port_intermediates_check.py: torch/numpy not importable (Debian python3-torch): skipped")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import ckpt  # noqa: E402
import v41  # noqa: E402

# Bounds (rel_rms). Measured with the reference's orders (issue 55) on sets a, c, d with Debian's
# torch 1.13.1 (AVX2 kernels, generic BLAS): every module output, every free-running intermediate
# and the logits are bit-exact (rel_rms 0, top-k rows all equal). Before the orders were followed,
# module teacher forcing gave attention rel_rms 1.5e-3 .. 4.0e-2 per layer (MoE and Engram were
# already exact) and the free-running logits 0.052 .. 0.060.
# Module level: bit-exact (0) under torch 1.13, the reference's own torch version, whose CPU exp,
# sum and sigmoid kernels the port shares with it. This is what makes a misreading show: summing an
# FP8 block in 8 interleaved lanes instead of K order changes one element of set d's layer-0 MoE
# output (module rel_rms 1.2e-05) and moves the free-running logits by 0.023, still inside the
# envelope below. Under another torch version the module bound is 1e-4 (a few isolated 1-ulp bf16
# flips from other exp/sum vector paths; one flipped element of a [P, 128] file is ~2e-5), which
# still catches every wrong order of issue 55 but the FP8 block order (attention: 8.6e-4 and more).
# Top-k rows: all equal (another torch: >= 0.99; the old orders gave 0.959 on set d).
# Free-running: a flip anywhere is re-quantized and grows, so there the bound is 2x the set's own
# envelope of a valid different accumulation order (manifest.json), per layer for attn_in / ffn_in
# (floored at 1e-3, the README's recommendation for the first layers), and for the logits.
SAME_TORCH = torch.__version__.startswith("1.13.")
MODULE = 0.0 if SAME_TORCH else 1e-4
LIMITS = {
    "module_attn_out": MODULE,
    "module_ffn_out": MODULE,
    "module_engram_delta": MODULE,
    "module_logits": MODULE,     # fp32 head on the golden final norm
    "module_topk_rows_equal": 1.0 if SAME_TORCH else 0.99,
    "free_factor": 2.0,          # x the manifest's free-running envelope
    "free_argmax_agree": 0.9,
}


def bf16_file(path, shape):
    u = np.fromfile(path, np.uint16).astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


def rel_rms(x, g):
    x = np.asarray(x, np.float64)
    g = np.asarray(g, np.float64)
    d = np.sqrt(((g ** 2).mean()))
    return float(np.sqrt(((x - g) ** 2).mean()) / d) if d > 0 else float(np.abs(x - g).max())


class GoldenSet:
    def __init__(self, gdir):
        self.dir = gdir
        self.name = os.path.basename(os.path.normpath(gdir))
        self.cfg = v41.Config.load(os.path.join(gdir, "config.json"))
        self.tensors = ckpt.read_safetensors(os.path.join(gdir, "model.safetensors"))
        self.weights = ckpt.dequantized(self.tensors)
        self.ids = json.load(open(os.path.join(gdir, "prompt.json")))["prompt_ids"]
        self.manifest = json.load(open(os.path.join(gdir, "manifest.json")))
        P = self.P = len(self.ids)
        c = self.cfg
        n_el = len(c.engram_layers)
        hid = np.fromfile(os.path.join(gdir, "debug", "engram_hash_ids.bin"), np.int32)
        hid = hid.reshape(-1, n_el, hid.size // (P + 8) // n_el)[:P]
        self.rows = {lid: torch.from_numpy(hid[None, :, i].astype(np.int64))
                     for i, lid in enumerate(c.engram_layers)}
        self.logits = np.fromfile(os.path.join(gdir, "logits_prefill_all.bin"),
                                  np.float32).reshape(P, -1)
        files = self.manifest["files"]
        self.debug = {}
        self.topk = {}
        for key, meta in files.items():
            if key.startswith("debug/topk_idxs_layer") and key.endswith("_prefill.bin"):
                lid = int(key[len("debug/topk_idxs_layer"):-len("_prefill.bin")])
                self.topk[lid] = np.fromfile(os.path.join(gdir, key), np.int32).reshape(meta["shape"])
            if not key.startswith("debug/") or "bfloat16" not in meta.get("dtype", ""):
                continue
            name = key[len("debug/"):-len(".bin")]
            if name.endswith("_prefill"):
                self.debug[name[:-len("_prefill")]] = bf16_file(os.path.join(gdir, key), meta["shape"])

    def model(self):
        m = v41.V41(self.cfg, self.weights, numerics="ref")
        m.set_formats(self.tensors)
        return m

    def envelope(self):
        return self.manifest["tolerance"]["envelope_valid_alternative_accumulation"]["free_running"]


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))[None]


def module_check(gs, m):
    """Teacher-forced module outputs -> {name: rel_rms}."""
    c = gs.cfg
    out = {}
    S = gs.P
    pos = torch.arange(S)
    tables = (v41.rope_tables(c, 0, pos, ref=True), v41.rope_tables(c, 1, pos, ref=True))
    shared = {}
    with torch.no_grad():
        for lid in c.engram_layers:
            hin = gs.debug[f"engram_in_layer{lid}"]
            y = m.engram(lid, t(hin), gs.rows[lid])[0].numpy()
            out[f"engram_delta{lid}"] = rel_rms(y - hin, gs.debug[f"engram_out_layer{lid}"] - hin)
        for lid in range(c.L):
            lp = f"layers.{lid}."
            ya = m.attention(lid, t(gs.debug[f"attn_in_layer{lid}"]), lp + "attn.", shared, tables)
            out[f"attn_out{lid}"] = rel_rms(ya[0].numpy(), gs.debug[f"attn_out_layer{lid}"])
            if lid in c.index_sources and lid in gs.topk:
                # the reference's list: ascending, invisible -> -1, offset by the prefill length
                idx, perm = torch.sort(shared["sel_idx"][0], dim=-1)
                ok = shared["sel_valid"][0].gather(-1, perm)
                mine = torch.where(ok, idx + S, torch.full_like(idx, -1)).numpy()
                out[f"topk{lid}"] = float((mine == gs.topk[lid]).all(-1).mean())
            yf = m.moe(t(gs.debug[f"ffn_in_layer{lid}"]), lp + "ffn.", c.n_exp, c.topk_exp)
            out[f"ffn_out{lid}"] = rel_rms(yf[0].numpy(), gs.debug[f"ffn_out_layer{lid}"])
        lg = t(gs.debug["final_norm"])[0] @ m.w("head.weight").t()
        out["logits"] = rel_rms(lg.numpy(), gs.logits)
    return out


def free_check(gs, m):
    dbg = {}
    with torch.no_grad():
        logits, _ = m(torch.tensor([gs.ids]), gs.rows, debug=dbg)
    out = {k: rel_rms(v[0].numpy(), gs.debug[k]) for k, v in dbg.items() if k in gs.debug}
    lg = logits[0].numpy()
    out["logits"] = rel_rms(lg, gs.logits)
    out["argmax_agree"] = float((lg.argmax(-1) == gs.logits.argmax(-1)).mean())
    return out


def fmt(vals):
    return " ".join(f"{v:.1e}" if v else "0" for v in vals)


def check(gdir, exact=False):
    t0 = time.time()
    gs = GoldenSet(gdir)
    c = gs.cfg
    m = gs.model()
    mod = module_check(gs, m)
    free = free_check(gs, m)
    env = gs.envelope()
    fails = []

    def bound(name, val, lim):
        if not val <= lim:
            fails.append(f"{name} {val:.3e} > {lim:.3e}")

    print(f"== {gs.name} (P={gs.P}, {c.L} layers)")
    print("  module teacher forcing (golden input -> module output), rel_rms per layer:")
    print(f"    attn_out     {fmt([mod[f'attn_out{l}'] for l in range(c.L)])}")
    print(f"    ffn_out      {fmt([mod[f'ffn_out{l}'] for l in range(c.L)])}")
    print(f"    engram delta {fmt([mod[f'engram_delta{l}'] for l in c.engram_layers])}"
          f"   (layers {c.engram_layers})")
    print(f"    head logits  {fmt([mod['logits']])}")
    tk = sorted(int(k[4:]) for k in mod if k.startswith("topk"))
    print("    top-k rows equal " + " ".join(f"L{l} {mod[f'topk{l}']:.4f}" for l in tk))
    for l in tk:
        if mod[f"topk{l}"] < LIMITS["module_topk_rows_equal"]:
            fails.append(f"module top-k rows equal, layer {l}: {mod[f'topk{l}']:.4f}")
    for l in range(c.L):
        bound(f"module attn_out layer {l}", mod[f"attn_out{l}"], LIMITS["module_attn_out"])
        bound(f"module ffn_out layer {l}", mod[f"ffn_out{l}"], LIMITS["module_ffn_out"])
    for l in c.engram_layers:
        bound(f"module engram delta layer {l}", mod[f"engram_delta{l}"], LIMITS["module_engram_delta"])
    bound("module head logits", mod["logits"], LIMITS["module_logits"])

    print("  free-running prefill, rel_rms per layer (envelope of a valid other order in []):")
    f = LIMITS["free_factor"]
    for kind in ("attn_in", "attn_out", "ffn_in", "ffn_out"):
        vals = [free[f"{kind}_layer{l}"] for l in range(c.L)]
        e = env.get(f"per_layer_prefill_rel_rms_{kind}")
        print(f"    {kind:9s} {fmt(vals)}" + (f"  [{fmt(e)}]" if e else ""))
        if e:
            # a per-layer envelope of 0 (layer 0) would demand bit-exactness; floor it at 1e-3,
            # which is what the README recommends for the first layers' inputs.
            for l in range(c.L):
                bound(f"free {kind} layer {l}", vals[l], max(f * e[l], 1e-3))
    for l in c.engram_layers:
        print(f"    engram layer {l}: in {free[f'engram_in_layer{l}']:.1e} out "
              f"{free[f'engram_out_layer{l}']:.1e}")
    el = env["logits_prefill_all.bin"]
    print(f"    final_norm {free['final_norm']:.2e}  logits {free['logits']:.4f} "
          f"[{el['rel_rms']:.4f}]  argmax_agree {free['argmax_agree']:.4f} [{el['argmax_agree']:.4f}]")
    bound("free logits", free["logits"], f * el["rel_rms"])
    if free["argmax_agree"] < LIMITS["free_argmax_agree"]:
        fails.append(f"free argmax agreement {free['argmax_agree']:.4f} < {LIMITS['free_argmax_agree']}")
    figs = [v for k, v in mod.items() if not k.startswith("topk")]
    figs += [v for k, v in free.items() if k != "argmax_agree"]
    n_exact = sum(v == 0 for v in figs)
    print(f"  bit-exact: {n_exact} of {len(figs)} compared outputs")
    if exact and n_exact != len(figs):
        fails.append(f"--exact: {len(figs) - n_exact} outputs differ")
    for x in fails:
        print(f"  FAIL: {x}")
    print(f"  {gs.name}: {'ok' if not fails else 'FAIL'} ({time.time() - t0:.1f} s)")
    return not fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sets", nargs="*", help="golden set directories (default: every set in --sets-dir)")
    ap.add_argument("--sets-dir", default=os.path.join(ROOT, "tests/data/golden"))
    ap.add_argument("--exact", action="store_true", help="fail unless every output is bit-exact")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}: module outputs must be "
          + ("bit-exact" if SAME_TORCH else f"within rel_rms {MODULE:g} (not the reference's torch 1.13)"))
    dirs = a.sets or sorted(os.path.join(a.sets_dir, s) for s in os.listdir(a.sets_dir)
                            if os.path.exists(os.path.join(a.sets_dir, s, "debug", "engram_hash_ids.bin")))
    if not dirs:
        print("no golden sets found")
        sys.exit(1)
    ok = all([check(d, a.exact) for d in dirs])
    print("OK" if ok else "FAIL: the port is outside the bounds above")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
