"""Released-checkpoint I/O for the training tool (MODEL.md §2), NumPy only.

Reads and writes single-shard safetensors with the dtypes the V4.1 checkpoint uses: BF16, F32,
F8_E4M3 (+ F8_E8M0 block scales), I8 packed E2M1 (MXFP4 routed experts, low nibble = even
element). Quantization follows `epd gen-model` (model/nano/nano_generator.cc) exactly: power-of-two
scales 2^ceil(log2(amax/448)) per 32x32 block (FP8) or 2^ceil(log2(amax/6)) per 1x32 (FP4),
values rounded to the nearest code, ties to the even code.
"""

import json
import struct

import numpy as np

_DTYPE_SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


def _e4m3_table():
    t = np.zeros(256, dtype=np.float64)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> 3) & 0xF
        m = c & 7
        if e == 0:
            v = m / 8.0 * 2.0 ** -6
        else:
            v = (1 + m / 8.0) * 2.0 ** (e - 7)
        if (c & 0x7F) == 0x7F:
            v = np.nan
        t[c] = s * v
    return t


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
_E4M3_MAG = E4M3[:127]  # codes 0..126, ascending magnitudes, 126 = 448
_E2M1_MAG = E2M1[:8]


def _nearest_code(a, table):
    """|a| (float64 array) -> nearest index in ascending `table`, ties to the even index."""
    n = len(table)
    idx = np.clip(np.searchsorted(table, a, side="left"), 1, n - 1)
    lo, hi = table[idx - 1], table[idx]
    up = (a - lo > hi - a) | ((a - lo == hi - a) & (idx % 2 == 0))
    return np.where(up, idx, idx - 1).astype(np.uint8)


def e4m3_encode(v):
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), 448.0)
    code = _nearest_code(a, _E4M3_MAG)
    return code | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)


def e2m1_encode(v):
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(v), 6.0)
    code = _nearest_code(a, _E2M1_MAG)
    return code | np.where(np.signbit(v), 0x8, 0).astype(np.uint8)


def ceil_log2(r):
    m, e = np.frexp(r)
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def bf16_bits(a):
    b = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(a):
    return (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


def fp8_quantize(w, bo=32, bi=32):
    """w [O, I] float -> (E4M3 codes uint8 [O, I], E8M0 bytes uint8 [ceil(O/bo), ceil(I/bi)])."""
    w = np.asarray(w, np.float64)
    O, I = w.shape
    nO, nI = -(-O // bo), -(-I // bi)
    pad = np.zeros((nO * bo, nI * bi))
    pad[:O, :I] = np.abs(w)
    amax = pad.reshape(nO, bo, nI, bi).max(axis=(1, 3))
    ex = ceil_log2(np.maximum(amax, 1e-30) / 448.0)
    inv = np.ldexp(1.0, -np.repeat(np.repeat(ex, bo, 0), bi, 1)[:O, :I])
    return e4m3_encode(w * inv), (ex + 127).astype(np.uint8)


def fp8_dequantize(codes, scales, bo=32, bi=32):
    O, I = codes.shape
    s = np.ldexp(1.0, scales.astype(np.int64) - 127)
    s = np.repeat(np.repeat(s, bo, 0), bi, 1)[:O, :I]
    return (E4M3[codes] * s).astype(np.float32)


def fp4_quantize(w):
    """w [O, I] -> (packed int8 [O, I/2], E8M0 uint8 [O, I/32])."""
    w = np.asarray(w, np.float64)
    O, I = w.shape
    blocks = w.reshape(O, I // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    ex = ceil_log2(np.maximum(amax, 1e-30) / 6.0)
    codes = e2m1_encode(blocks * np.ldexp(1.0, -ex)[:, :, None]).reshape(O, I)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, (ex + 127).astype(np.uint8)


def fp4_dequantize(packed, scales):
    p = packed.view(np.uint8)
    O = p.shape[0]
    codes = np.empty((O, p.shape[1] * 2), np.uint8)
    codes[:, 0::2] = p & 0xF
    codes[:, 1::2] = p >> 4
    s = np.ldexp(1.0, scales.astype(np.int64) - 127)
    return (E2M1[codes] * np.repeat(s, 32, 1)).astype(np.float32)


def read_safetensors(path):
    """-> {name: (dtype string, shape list, raw numpy array of the storage dtype)}"""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        raw = data[base + b:base + e]
        if dt == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dt == "F32":
            arr = np.frombuffer(raw, np.float32)
        elif dt == "I8":
            arr = np.frombuffer(raw, np.int8)
        elif dt in ("F8_E4M3", "F8_E8M0"):
            arr = np.frombuffer(raw, np.uint8)
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dt}")
        out[name] = (dt, shape, arr.reshape(shape).copy())
    return out


def dequantized(tensors):
    """{name: (dt, shape, arr)} -> {name: float32 array}; `.scale` tensors folded into weights."""
    out = {}
    for name, (dt, shape, arr) in tensors.items():
        if name.endswith(".scale") and not name.endswith("engram.embed.scale"):
            continue
        if name.endswith(".scale"):
            continue
        if dt == "F8_E4M3":
            sname = name[:-len(".weight")] + ".scale"
            sc = tensors[sname][2]
            bo = -(-shape[0] // sc.shape[0])
            bi = -(-shape[1] // sc.shape[1])
            out[name] = fp8_dequantize(arr, sc, bo, bi)
        elif dt == "I8":
            sname = name[:-len(".weight")] + ".scale"
            out[name] = fp4_dequantize(arr, tensors[sname][2])
        else:
            out[name] = arr.astype(np.float32)
    return out


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype string, numpy array already in the storage dtype).

    Same layout as model/safetensors_writer.cc: names sorted, data packed in that order."""
    items = sorted(tensors, key=lambda t: t[0])
    header, blobs, off = {}, [], 0
    for name, dt, arr in items:
        if dt == "BF16":
            raw = bf16_bits(arr).tobytes()
        elif dt == "F32":
            raw = np.ascontiguousarray(arr, np.float32).tobytes()
        else:
            raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off
