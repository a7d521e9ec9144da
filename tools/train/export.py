"""Exports trained weights to the released checkpoint format (as `epd gen-model` writes it).

Every tensor of the starting checkpoint (`--init`, an `epd gen-model` directory) is written
again with its original dtype: BF16 / F32 as is, FP8 E4M3 weights with E8M0 scales per 32x32
block (the Engram table per 1x32), packed MXFP4 routed experts with E8M0 scales per 1x32; the
values come from the trained state when it holds the tensor, else from the starting checkpoint.
config.json, tokenizer.json, tokenizer_config.json and engram_constants.json are copied.

  python3 tools/train/export.py --init DIR --state state.pt --out DIR [--only-prefix mtp.]

--only-prefix P: only tensors whose name starts with P are taken from the state and quantized;
every other tensor (and its scale) is copied byte for byte from --init (used to add the trained
DSpark stages to the trained main model without touching its weights).
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402

COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "engram_constants.json")


def export(init_dir, state, out_dir, only_prefix=None):
    """state: {checkpoint name: float32 numpy array} (trained values)."""
    tensors = ckpt.read_safetensors(os.path.join(init_dir, "model.safetensors"))
    base = ckpt.dequantized(tensors)
    out = []
    for name, (dt, shape, raw) in tensors.items():
        if only_prefix is not None and not name.startswith(only_prefix):
            out.append((name, dt, raw))  # as stored (BF16 values are exact: same bits again)
            continue
        if name.endswith(".scale"):
            continue
        value = state.get(name, base.get(name))
        if dt == "BF16":
            out.append((name, "BF16", np.asarray(value, np.float32)))
        elif dt == "F32":
            out.append((name, "F32", np.asarray(value, np.float32)))
        elif dt == "F8_E4M3":
            sname = name[:-len(".weight")] + ".scale"
            sc_shape = tensors[sname][1]
            bo = -(-shape[0] // sc_shape[0])
            bi = -(-shape[1] // sc_shape[1])
            codes, scales = ckpt.fp8_quantize(value, bo, bi)
            assert list(scales.shape) == list(sc_shape), name
            out.append((name, "F8_E4M3", codes))
            out.append((sname, "F8_E8M0", scales))
        elif dt == "I8":
            packed, scales = ckpt.fp4_quantize(value)
            out.append((name, "I8", packed))
            out.append((name[:-len(".weight")] + ".scale", "F8_E8M0", scales))
        else:
            raise ValueError(f"{name}: unexpected dtype {dt}")
    os.makedirs(out_dir, exist_ok=True)
    total = ckpt.write_safetensors(os.path.join(out_dir, "model.safetensors"), out)
    index = {"metadata": {"total_size": total},
             "weight_map": {n: "model.safetensors" for n, _, _ in sorted(out)}}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    for name in COPIED:
        src = os.path.join(init_dir, name)
        dst = os.path.join(out_dir, name)
        if os.path.exists(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
    return total


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--state", required=True, help="train.py's state.pt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only-prefix", default=None)
    a = ap.parse_args()
    sd = torch.load(a.state)["params"]
    export(a.init, {k: v.numpy() for k, v in sd.items()}, a.out, a.only_prefix)
    print(f"export: wrote {a.out}")


if __name__ == "__main__":
    main()
