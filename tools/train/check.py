"""The training tool's own test (ctest train_tool_torch_test; exit 77 = skipped without torch).

1. The PyTorch module reproduces both golden sets (official reference logits) within the golden
   envelope (golden_check.py, "ref" numerics).
2. The stored parity references of the committed demo model (tests/data/trained_nano_parity/,
   which tests/model/trained_nano_test.cc compares the C++ engine against) are what the module
   computes now for that checkpoint.
3. The exporter writes the committed checkpoint back value for value (every tensor dequantizes to
   the same numbers), in the dtypes and shapes of the released format; with --only-prefix mtp.
   (how the trained DSpark stages were added) every other tensor comes back byte for byte.
4. The DSpark draft pass used to train the mtp.* stages (dspark.py) reproduces the official
   reference's draft logits of both golden sets (dspark_golden_check.py).
"""

import os
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError:
    print("check.py: torch/numpy not installed (python3-torch): skipped")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import ckpt  # noqa: E402
import dspark_golden_check  # noqa: E402
import export  # noqa: E402
import golden_check  # noqa: E402
import parity  # noqa: E402


def main():
    torch.set_num_threads(1)
    ok = True
    for s in ("v41-tiny-a", "v41-tiny-c"):
        ok &= golden_check.check(os.path.join(ROOT, "tests/data/golden", s), modes=("ref",))
        ok &= dspark_golden_check.check(os.path.join(ROOT, "tests/data/golden", s))
    model_dir = os.path.join(ROOT, "models/epd-nano")
    pdir = os.path.join(ROOT, "tests/data/trained_nano_parity")
    import json
    prompts = json.load(open(os.path.join(pdir, "prompts.json")))["prompts"]
    stored = np.fromfile(os.path.join(pdir, "logits.bin"), np.float32).reshape(len(prompts), -1)
    fresh = parity.reference_logits(model_dir, prompts)
    diff = float(np.abs(fresh - stored).max())
    rel = float(np.sqrt(((fresh - stored) ** 2).mean() / (stored ** 2).mean()))
    print(f"stored parity logits vs a fresh torch run: max |diff| {diff:.2e}, rel_rms {rel:.2e}")
    # Same code; another BLAS may accumulate in another order and flip bf16 roundings.
    ok &= rel < 0.02
    with tempfile.TemporaryDirectory() as tmp:
        export.export(model_dir, {}, tmp)
        a = ckpt.read_safetensors(os.path.join(model_dir, "model.safetensors"))
        b = ckpt.read_safetensors(os.path.join(tmp, "model.safetensors"))
        same_layout = all(a[n][0] == b[n][0] and a[n][1] == b[n][1] for n in a) and a.keys() == b.keys()
        da, db = ckpt.dequantized(a), ckpt.dequantized(b)
        same_values = all(np.array_equal(da[n], db[n]) for n in da)
        print(f"exporter round trip: layout {same_layout}, values {same_values}")
        ok &= same_layout and same_values
        # Only the DSpark stages re-exported (zeroed here, so they do change): the rest is copied.
        zero = {n: np.zeros_like(v) for n, v in da.items() if n.startswith("mtp.")}
        export.export(model_dir, zero, tmp, only_prefix="mtp.")
        c = ckpt.read_safetensors(os.path.join(tmp, "model.safetensors"))
        kept = all(a[n][2].tobytes() == c[n][2].tobytes() for n in a if not n.startswith("mtp."))
        changed = any(a[n][2].tobytes() != c[n][2].tobytes() for n in a if n.startswith("mtp."))
        print(f"exporter --only-prefix mtp.: main tensors byte-identical {kept}, mtp.* rewritten "
              f"{changed}")
        ok &= kept and changed
    print("OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
