"""DeepSeek-V4.1-Flash architecture in PyTorch, for training at nano scale (issue 18).

Written from MODEL.md §3 (copied semantics: model/ and kernels/cpu/ of this repo). One module
holds every tensor of the released checkpoint under its checkpoint name (float32 master copies
of the dequantized values); `forward` is the reference prefill path (start_pos 0, one shot):
CED encoder/decoder layer roles, SWA window, CSA compressors (ratio 2 softmax-pooled with wgate,
ratio 1 plain), the indexer with Full / Reuse / Reindex roles and the candidate-block mask, mHC
with the delayed pre-mix and Sinkhorn, MoE with sqrt-softplus routing + bias, route weight
before w2, SwiGLU clamps and a shared expert, Engram hashing (rows precomputed by
`engram_rows`) and its gate, and the `main_hidden` taps of the DSpark target layers.

Numerics modes (`numerics=`):
  "ref"   emulates the reference: bf16 rounding of activations and GEMM outputs, FP8 activation
          quantization before FP8/FP4 GEMMs, FP8 window KV, FP4 compressed KV and index keys,
          bf16 attention probabilities, and the reference's summation orders (FP8/FP4 block
          GEMMs, the 64-chunk online-softmax sparse attention, plain matmuls, mHC, Engram,
          indexer; issue 55): bit-exact with the golden sets under torch 1.13
          (port_intermediates_check.py). Slow (Python loops over K); checks only.
  "train" float32 everywhere; weights (FP8 32x32 / FP4 1x32) and KV (FP8 window, FP4
          compressed) are fake-quantized with a straight-through estimator, so the exported
          quantized checkpoint computes what was trained.
  "fp32"  float32, no quantization at all.

The top-k selections (indexer, candidate blocks, MoE routing) use the project's tie rule
(descending value, lower index first) through a stable sort.
"""

import json
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckpt


class Config:
    def __init__(self, config_json):
        c = config_json.get("text_config", config_json)
        self.raw = config_json
        self.V = c["vocab_size"]
        self.D = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        self.H = c["num_attention_heads"]
        self.hd = c["head_dim"]
        self.rd = c["qk_rope_head_dim"]
        self.ql = c["q_lora_rank"]
        self.ol = c["o_lora_rank"]
        self.G = c["o_groups"]
        self.swiglu = float(c["swiglu_limit"])
        self.eps = float(c["rms_norm_eps"])
        self.theta = float(c["rope_theta"])
        rs = c["rope_scaling"]
        self.yarn_factor = float(rs["factor"])
        self.beta_fast = float(rs["beta_fast"])
        self.beta_slow = float(rs["beta_slow"])
        self.orig_len = float(rs["original_max_position_embeddings"])
        self.ctheta = float(c["compress_rope_theta"])
        self.n_exp = c["n_routed_experts"]
        self.topk_exp = c["num_experts_per_tok"]
        self.inter = c["moe_intermediate_size"]
        self.route_scale = float(c["routed_scaling_factor"])
        self.window = c["sliding_window"]
        self.ratios = c["compress_ratios"]
        self.kv_sources = c["kv_source_layer_ids"]
        self.index_sources = c["index_source_layer_ids"]
        self.idx_heads = c["index_n_heads"]
        self.idx_hd = c["index_head_dim"]
        self.idx_topk = c["index_topk"]
        self.cand_source = c["candidate_source_layer_id"]
        self.cand_blocks = c["candidate_topk_blocks"]
        self.cand_bs = c["candidate_block_size"]
        self.hc = c["hc_mult"]
        self.sinkhorn = c["hc_sinkhorn_iters"]
        self.hc_eps = float(c["hc_eps"])
        self.engram_layers = c["engram_layer_ids"]
        self.engram_rows = c["engram_num_embeddings"]
        self.eg_heads = c["engram_n_heads"]
        self.eg_hd = c["engram_head_dim"]
        self.eg_ngram = c["engram_max_ngram_size"]
        self.n_mtp = c["num_nextn_predict_layers"]
        self.targets = c["dspark_target_layer_ids"]
        self.dspark_exp = c["dspark_n_routed_experts"]
        self.dspark_topk = c["dspark_num_experts_per_tok"]

    @staticmethod
    def load(path):
        with open(path) as f:
            return Config(json.load(f))


# ----------------------------------------------------------------------------- numerics helpers


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def _round_e4m3(v):
    """v already scaled into [-448, 448] -> nearest E4M3 value (ties to even)."""
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -6))).clamp(min=-6)
    step = torch.pow(2.0, e - 3)
    return torch.round(v / step) * step


def _round_e2m1(v):
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp_min(1.0))).clamp(min=0)
    step = torch.pow(2.0, e - 1)
    return torch.round(v / step) * step


def _ceil_pow2(r):
    return torch.pow(2.0, torch.ceil(torch.log2(r)))


def act_fp8(x, block=32, amin=1e-4):
    """Per-`block` along the last dim: UE8M0 scale, E4M3 values (dequantized)."""
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(amin)
    s = _ceil_pow2(amax * (1.0 / 448.0))
    return (_round_e4m3((xb / s).clamp(-448, 448)) * s).reshape(shp)


def fp4_index(x, block=32):
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0 ** -126)
    s = _ceil_pow2(amax * (1.0 / 6.0))
    return (_round_e2m1((xb / s).clamp(-6, 6)) * s).reshape(shp)


def fp4_kv(x, block=16):
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(6.0 * 2.0 ** -9)
    s = _round_e4m3(amax / 6.0)
    return (_round_e2m1((xb / s).clamp(-6, 6)) * s).reshape(shp)


def w_fp8(w, bo=32, bi=32):
    """Weight [O, I] -> FP8 E4M3 with pow2 scales per bo x bi block (as the exporter)."""
    O, I = w.shape
    pO, pI = -(-O // bo) * bo, -(-I // bi) * bi
    wp = F.pad(w, (0, pI - I, 0, pO - O))
    b = wp.reshape(pO // bo, bo, pI // bi, bi)
    amax = b.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30)
    s = _ceil_pow2(amax / 448.0)
    q = (_round_e4m3((b / s).clamp(-448, 448)) * s).reshape(pO, pI)
    return q[:O, :I]


def w_fp4(w):
    O, I = w.shape
    b = w.reshape(O, I // 32, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    s = _ceil_pow2(amax / 6.0)
    return (_round_e2m1((b / s).clamp(-6, 6)) * s).reshape(O, I)


def _dot_order(K, pairs):
    """K indices in index order, or in oneDNN's bf16 pair order (1, 0, 3, 2, ...; an odd last
    element last)."""
    if not pairs:
        return list(range(K))
    return [k ^ 1 if (k ^ 1) < K else k for k in range(K)]


def matmul_ordered(x, w, pairs=False):
    """x [..., K] @ w [O, K]^T in fp32 with every dot summed from 0 in a fixed order, each
    addition rounded: the reference's plain matmuls (torch 1.13 on the CPU): fp32 ones in index
    order (reference BLAS sgemm), bf16 ones (pairs=True) in oneDNN's vdpbf16ps order. The products
    are exact for bf16 inputs. A Python loop over K of [N, O] ops, for "ref" numerics only."""
    shp = x.shape
    K = shp[-1]
    xf = x.reshape(-1, K).t().contiguous()  # [K, N]
    wt = w.t().contiguous()  # [K, O]
    out = torch.zeros(xf.shape[1], wt.shape[1], dtype=torch.float32)
    for k in _dot_order(K, pairs):
        out.add_(xf[k].unsqueeze(1) * wt[k].unsqueeze(0))
    return out.view(*shp[:-1], wt.shape[1])


def gemm_block_k_order(x, w, block=32):
    """x [..., K] @ w[O, K]^T in the reference's order (the FP8/FP4 block GEMM): per K block of 32,
    ((0 + x0 w0) + x1 w1) + ... + x31 w31 with every addition rounded to fp32, then the blocks'
    terms added in fp32 in K order from 0. x and w hold dequantized values with power-of-two
    block scales (constant over a K block for each row of x and of w), so summing the dequantized
    products is the same as scaling the code dot products: every step is exact up to the same
    fp32 roundings. A Python loop over K of [N, O] tensor ops: slow but only used by "ref"."""
    shp = x.shape
    K = shp[-1]
    xf = x.reshape(-1, K).t().contiguous()  # [K, N]
    wt = w.t().contiguous()  # [K, O]
    out = torch.zeros(xf.shape[1], wt.shape[1], dtype=torch.float32)
    for k0 in range(0, K, block):
        acc = torch.zeros_like(out)
        for k in range(k0, min(k0 + block, K)):
            acc.add_(xf[k].unsqueeze(1) * wt[k].unsqueeze(0))
        out.add_(acc)
    return out.view(*shp[:-1], wt.shape[1])


def sparse_attention_ref(q, keys, valid, sink, scale, chunk=64):
    """The reference's sparse attention kernel, in its order.

    q [B, S, H, hd]; keys [B, S, L, hd] each row's index list (window part then compressed part;
    K and V are the same vector), valid [B, S, L] (False = a -1 entry); sink [H]. Scores q.k
    summed in dim order in fp32, times fp32(scale); the list in chunks of `chunk` with an online
    softmax: running max from -1e30, p = exp(s - max), den = den * alpha + the chunk's sum of p,
    num = num * alpha + (the chunk's sum_j bf16(p_j) kv_j, formed in list order from 0); then
    den += exp(sink - max), out = bf16(num / den). Returns [B, S, H, hd]."""
    B, S, H, hd = q.shape
    L = keys.shape[2]
    qt = q.permute(3, 0, 1, 2).unsqueeze(-1).contiguous()  # [hd, B, S, H, 1]
    kt = keys.permute(3, 0, 1, 2).unsqueeze(3).contiguous()  # [hd, B, S, 1, L]
    s = torch.zeros(B, S, H, L, dtype=torch.float32)
    for d in range(hd):
        s = s + qt[d] * kt[d]
    s = s * torch.tensor(scale, dtype=torch.float32)
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    m = torch.full((B, S, H), -1e30, dtype=torch.float32)
    den = torch.zeros(B, S, H, dtype=torch.float32)
    num = torch.zeros(B, S, H, hd, dtype=torch.float32)
    vk = keys.unsqueeze(2)  # [B, S, 1, L, hd]
    for c0 in range(0, L, chunk):
        c1 = min(c0 + chunk, L)
        sc = s[..., c0:c1].contiguous()
        m_new = torch.maximum(m, sc.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(sc - m_new.unsqueeze(-1))
        den = den * alpha + p.sum(-1)
        pb = bf16(p)
        cs = torch.zeros_like(num)
        for j in range(c1 - c0):
            cs = cs + pb[..., j].unsqueeze(-1) * vk[:, :, :, c0 + j]
        num = num * alpha.unsqueeze(-1) + cs
        m = m_new
    den = den + torch.exp(sink.view(1, 1, H) - m)
    return bf16(num / den.unsqueeze(-1))


def ste(x, q):
    return x + (q - x).detach()


def stable_topk_mask(score, k):
    """Boolean mask of the top-k entries along the last dim; ties -> lower index first."""
    n = score.shape[-1]
    k = min(k, n)
    # stable descending sort keeps the lower index first among equal values.
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros_like(score, dtype=torch.bool)
    mask.scatter_(-1, order, True)
    return mask, order


_LIBM = None


def _libm():
    global _LIBM
    if _LIBM is None:
        import ctypes
        import ctypes.util
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for f in ("powf", "cosf", "sinf"):
            getattr(lib, f).restype = ctypes.c_float
        lib.powf.argtypes = (ctypes.c_float, ctypes.c_float)
        lib.cosf.argtypes = lib.sinf.argtypes = (ctypes.c_float,)
        _LIBM = lib
    return _LIBM


def _f32(v):
    return float(np.float32(v))


def rope_tables_ref(cfg, ratio, positions):
    """The reference's tables, in its fp32 arithmetic (precompute_freqs_cis): freq_i =
    1 / powf(base, fp32(2i) / rd); YaRN: ramp = (i - low) / (high - low) clamped, smooth = 1 - ramp,
    freq = freq / factor * (1 - smooth) + freq * smooth; angle = fp32(pos * freq); cos/sin by
    glibc's cosf/sinf (torch.polar). Used by "ref" numerics."""
    m = _libm()
    n = cfg.rd // 2
    base = cfg.theta if ratio == 0 else cfg.ctheta
    f = np.float32
    freq = [f(1.0) / f(m.powf(base, _f32(f(2 * i) / f(cfg.rd)))) for i in range(n)]
    if ratio != 0:
        def corr(r):
            return cfg.rd * math.log(cfg.orig_len / (r * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(cfg.beta_fast)), 0.0)
        high = min(math.ceil(corr(cfg.beta_slow)), float(cfg.rd - 1))
        if low == high:
            high += 0.001
        for i in range(n):
            ramp = min(max((f(i) - f(low)) / f(high - low), f(0)), f(1))
            smooth = f(1) - ramp
            freq[i] = freq[i] / f(cfg.yarn_factor) * (f(1) - smooth) + freq[i] * smooth
    ps = [int(p) for p in positions]
    cos = np.empty((len(ps), n), np.float32)
    sin = np.empty((len(ps), n), np.float32)
    for a, p in enumerate(ps):
        for i in range(n):
            ang = _f32(f(p) * freq[i])
            cos[a, i] = m.cosf(ang)
            sin[a, i] = m.sinf(ang)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def rope_tables(cfg, ratio, positions, ref=False):
    """cos, sin [len(positions), rd/2] for the layer kind (MODEL.md §3 step 4)."""
    if ref:
        return rope_tables_ref(cfg, ratio, positions)
    n = cfg.rd // 2
    i = torch.arange(n, dtype=torch.float64)
    if ratio == 0:
        freq = 1.0 / cfg.theta ** (2 * i / cfg.rd)
    else:
        th = cfg.ctheta
        freq = 1.0 / th ** (2 * i / cfg.rd)

        def corr(r):
            return cfg.rd * math.log(cfg.orig_len / (2 * math.pi * r)) / (2 * math.log(th))

        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), cfg.rd - 1)
        ramp = ((i - low) / max(high - low, 0.001)).clamp(0, 1)
        freq = freq / cfg.yarn_factor * ramp + freq * (1 - ramp)
    freq = freq.to(torch.float32)
    ang = positions.to(torch.float32)[:, None] * freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin, rd, inverse=False):
    """Interleaved RoPE on the last `rd` dims of x [..., S, (heads,) dim]; cos/sin [S, rd/2]."""
    nope, tail = x[..., :-rd], x[..., -rd:]
    t = tail.reshape(*tail.shape[:-1], rd // 2, 2)
    return _rope_impl(nope, t[..., 0], t[..., 1], cos, sin, inverse)


def _rope_impl(nope, a, b, cos, sin, inverse):
    # a, b [B, S, ..., n]; cos/sin [S, n]
    while cos.dim() < a.dim() - 1:
        cos = cos.unsqueeze(-2)
        sin = sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    tail = torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([nope, tail], dim=-1)


# ----------------------------------------------------------------------------- the model


class V41(nn.Module):
    """All checkpoint tensors as float32 parameters, keyed by checkpoint name."""

    def __init__(self, cfg, weights, numerics="train"):
        super().__init__()
        self.cfg = cfg
        self.numerics = numerics
        self.names = {}
        self.params = nn.ParameterDict()
        self.buffers_np = {}
        for name, arr in weights.items():
            key = name.replace(".", "__")
            self.names[name] = key
            self.params[key] = nn.Parameter(torch.from_numpy(np.array(arr, np.float32)))
        self.fp8_names = set()
        self.fp4_names = set()
        self.prequantized = set()  # "train" numerics: weights already holding quantized values

    def set_formats(self, tensors):
        """Records which tensors the checkpoint stores as FP8 / FP4 (fake-quant targets)."""
        for name, (dt, _, _) in tensors.items():
            if dt == "F8_E4M3" and not name.endswith("engram.embed.weight"):
                self.fp8_names.add(name)
            elif dt == "I8":
                self.fp4_names.add(name)

    def freeze_quantized(self, keep=lambda name: False):
        """Replaces every tensor for which keep(name) is false by its fake-quantized value, once,
        and stops quantizing it per call ("train" numerics, frozen weights: same values, cheaper)."""
        with torch.no_grad():
            for name, key in self.names.items():
                if not keep(name):
                    self.params[key].data = self.w(name).detach().clone()
                    self.params[key].requires_grad_(False)
                    self.prequantized.add(name)

    def w(self, name):
        p = self.params[self.names[name]]
        if self.numerics == "train" and name not in self.prequantized:
            if name in self.fp8_names:
                return ste(p, w_fp8(p))
            if name in self.fp4_names:
                return ste(p, w_fp4(p))
            if name.endswith("engram.embed.weight"):
                return ste(p, w_fp8(p, 1, 32))
        return p

    def has(self, name):
        return name in self.names

    # -- numerics primitives
    def R(self, x):
        return bf16(x) if self.numerics == "ref" else x

    def qlinear(self, x, name):
        """FP8/FP4 linear: act quant per 32 (ref), fp32 GEMM, bf16 out (ref).

        "ref" sums as the reference's block GEMM does (gemm_block_k_order)."""
        if self.numerics == "ref":
            return bf16(gemm_block_k_order(act_fp8(x), self.w(name)))
        return self.R(x @ self.w(name).t())

    def bf16_linear(self, x, name):
        if self.numerics == "ref":
            return bf16(matmul_ordered(bf16(x), self.w(name), pairs=True))
        return self.R(self.R(x) @ self.w(name).t())

    def f32_linear(self, x, w):
        """A plain fp32 matmul (mHC mixes, compressor ratio 2, MoE gate, LM head)."""
        if self.numerics == "ref":
            return matmul_ordered(x, w)
        return x @ w.t()

    def rmsnorm(self, x, name):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps)
        return self.R(y * self.w(name))

    def kv_fp8(self, x):
        if self.numerics == "ref":
            return act_fp8(x)
        if self.numerics == "train":
            return ste(x, act_fp8(x))
        return x

    def kv_fp4(self, x, index):
        f = fp4_index if index else fp4_kv
        if self.numerics == "ref":
            return self.R(f(x))
        if self.numerics == "train":
            return ste(x, f(x))
        return x

    # -- mHC
    def mixes(self, h, pre):
        c = self.cfg
        hc = c.hc
        hf = h.flatten(-2)
        m = self.f32_linear(hf, self.w(pre + "_fn")) * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + c.eps)
        s = self.w(pre + "_scale")
        b = self.w(pre + "_base")
        p = torch.sigmoid(m[..., :hc] * s[0] + b[:hc]) + c.hc_eps
        q = 2 * torch.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
        cm = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
        if self.numerics == "ref":
            # the reference's softmax: exp(x - max) / (sum in index order), not x * (1 / sum)
            e = torch.exp(cm - cm.amax(-1, keepdim=True))
            tot = e[..., 0:1]
            for j in range(1, hc):
                tot = tot + e[..., j:j + 1]
            cm = e / tot + c.hc_eps
        else:
            cm = torch.softmax(cm, dim=-1) + c.hc_eps
        cm = cm / (cm.sum(-2, keepdim=True) + c.hc_eps)
        for _ in range(c.sinkhorn - 1):
            cm = cm / (cm.sum(-1, keepdim=True) + c.hc_eps)
            cm = cm / (cm.sum(-2, keepdim=True) + c.hc_eps)
        return p, q, cm

    def hc_pre(self, h, pre):
        return self.R((h * pre.unsqueeze(-1)).sum(-2))

    def hc_post(self, y, res, post, comb):
        # out[k] = post[k]*y + sum_j comb[j,k]*res[j]
        if self.numerics == "ref":  # the reference forms the sum over j first
            acc = torch.zeros_like(res)
            for j in range(res.shape[-2]):
                acc = acc + comb[..., j, :].unsqueeze(-1) * res[..., j, :].unsqueeze(-2)
            return bf16(post.unsqueeze(-1) * y.unsqueeze(-2) + acc)
        out = post.unsqueeze(-1) * y.unsqueeze(-2)
        for j in range(res.shape[-2]):
            out = out + comb[..., j, :].unsqueeze(-1) * res[..., j, :].unsqueeze(-2)
        return self.R(out)

    # -- attention
    def attention(self, lid, x, pre, shared, tables):
        c = self.cfg
        B, S, _ = x.shape
        ratio = c.ratios[lid]
        cos, sin = tables[0 if ratio == 0 else 1]
        pos = torch.arange(S)
        qr = self.rmsnorm(self.qlinear(x, pre + "wq_a.weight"), pre + "q_norm.weight")
        q = self.qlinear(qr, pre + "wq_b.weight").view(B, S, c.H, c.hd)
        q = self.R(apply_rope(q, cos, sin, c.rd))
        kv = self.rmsnorm(self.qlinear(x, pre + "wkv.weight"), pre + "kv_norm.weight")
        kv = self.kv_fp8(self.R(apply_rope(kv, cos, sin, c.rd)))
        scale = c.hd ** -0.5
        if self.numerics == "ref":
            o = self._attention_ref(lid, x, q, qr, kv, pre, shared, tables)
            return self._attention_out(o, pre, cos, sin)
        # window part [B, H, S, S]
        qh = q.permute(0, 2, 1, 3).reshape(B, c.H * S, c.hd)
        sw = torch.bmm(qh, kv.transpose(1, 2)).view(B, c.H, S, S) * scale
        i = pos[:, None]
        j = pos[None, :]
        wmask = (j <= i) & (j > i - c.window)
        sw = sw.masked_fill(~wmask, float("-inf"))
        scores = [sw]
        gathered = None
        if ratio > 0:
            if lid in c.kv_sources:
                self._compress(lid, x, pre, shared, tables)
            if lid in c.index_sources:
                self._index(lid, x, qr, pre, shared, tables)
            ckv = shared["ckv"]
            idx, valid = shared["sel_idx"], shared["sel_valid"]  # [B, S, k]
            if idx.shape[-1] > 0:
                Tp = ckv.shape[1]
                flat = (idx + (torch.arange(B) * Tp).view(B, 1, 1)).reshape(-1)
                ckv_g = ckv.reshape(B * Tp, c.hd)[flat].view(B, S, -1, c.hd)  # [B, S, k, hd]
                sc = torch.matmul(q, ckv_g.transpose(-1, -2)) * scale  # [B, S, H, k]
                sc = sc.masked_fill(~valid.unsqueeze(2), float("-inf")).permute(0, 2, 1, 3)
                scores.append(sc)
                gathered = ckv_g
        s_all = torch.cat(scores, dim=-1)
        sink = self.w(pre + "attn_sink").view(1, c.H, 1, 1)
        mx = torch.maximum(s_all.amax(-1, keepdim=True), sink).detach()
        p = torch.exp(s_all - mx)
        den = p.sum(-1, keepdim=True) + torch.exp(sink - mx)
        if self.numerics == "ref":
            p = bf16(p)
        pw = p[..., :S]
        o = torch.bmm(pw.reshape(B, c.H * S, S), kv).view(B, c.H, S, c.hd)
        if gathered is not None:
            pc = p[..., S:].permute(0, 2, 1, 3)  # [B, S, H, k]
            o = o + torch.matmul(pc, gathered).permute(0, 2, 1, 3)
        o = self.R((o / den).permute(0, 2, 1, 3))
        return self._attention_out(o, pre, cos, sin)

    def _attention_ref(self, lid, x, q, qr, kv, pre, shared, tables):
        """"ref" numerics: the reference's index list and sparse attention kernel."""
        c = self.cfg
        B, S, _ = x.shape
        W = c.window
        pos = torch.arange(S)
        # window part of row i: positions max(0, i-W+1) .. +W-1, entries > i are -1
        wpos = (pos - (W - 1)).clamp_min(0)[:, None] + torch.arange(W)[None, :]  # [S, W]
        keys = [kv[:, wpos.clamp_max(S - 1)]]  # [B, S, W, hd]
        valid = [(wpos <= pos[:, None]).unsqueeze(0).expand(B, S, W)]
        if c.ratios[lid] > 0:
            if lid in c.kv_sources:
                self._compress(lid, x, pre, shared, tables)
            if lid in c.index_sources:
                self._index(lid, x, qr, pre, shared, tables)
            ckv = shared["ckv"]
            idx, ok = shared["sel_idx"], shared["sel_valid"]  # [B, S, k]
            if idx.shape[-1] > 0:
                # the reference's top-k list is sorted ascending, invisible entries -1 in place
                idx, perm = torch.sort(idx, dim=-1)
                ok = ok.gather(-1, perm)
                Tp = ckv.shape[1]
                flat = (idx + (torch.arange(B) * Tp).view(B, 1, 1)).reshape(-1)
                keys.append(ckv.reshape(B * Tp, c.hd)[flat].view(B, S, -1, c.hd))
                valid.append(ok)
        return sparse_attention_ref(q, torch.cat(keys, 2), torch.cat(valid, 2),
                                    self.w(pre + "attn_sink"), c.hd ** -0.5)

    def _attention_out(self, o, pre, cos, sin):
        """o [B, S, H, hd] (bf16) -> inverse RoPE, grouped wo_a, wo_b."""
        c = self.cfg
        B, S = o.shape[:2]
        o = self.R(apply_rope(o, cos, sin, c.rd, inverse=True))
        og = o.reshape(B, S, c.G, c.H * c.hd // c.G)
        wo_a = self.w(pre + "wo_a.weight").view(c.G, c.ol, c.H * c.hd // c.G)
        if self.numerics == "ref":
            wo_a = bf16(wo_a)
        if self.numerics == "ref":
            y = torch.stack([matmul_ordered(og[:, :, g], wo_a[g], pairs=True).view(B * S, c.ol)
                             for g in range(c.G)])
        else:
            y = torch.bmm(og.permute(2, 0, 1, 3).reshape(c.G, B * S, -1), wo_a.transpose(1, 2))
        y = self.R(y.view(c.G, B, S, c.ol).permute(1, 2, 0, 3)).reshape(B, S, c.G * c.ol)
        return self.qlinear(y, pre + "wo_b.weight")

    def _compress(self, lid, x, pre, shared, tables):
        c = self.cfg
        ratio = c.ratios[lid]
        B, S, _ = x.shape
        T = S // ratio
        cp = pre + "compressor."
        if ratio == 1:
            lat = self.bf16_linear(x, cp + "wkv.weight")
        else:
            xx = x[:, :T * ratio]
            kv = self.f32_linear(xx, self.w(cp + "wkv.weight"))
            g = self.f32_linear(xx, self.w(cp + "wgate.weight"))
            kv = kv.view(B, T, ratio, -1)
            g = torch.softmax(g.view(B, T, ratio, -1), dim=2)
            lat = self.R((kv * g).sum(2))
        lat = self.rmsnorm(lat, cp + "norm.weight")
        gpos = torch.arange(T) * ratio
        cos, sin = rope_tables(c, ratio, gpos, ref=self.numerics == "ref")
        ik = self.rmsnorm(self.bf16_linear(lat, pre + "indexer.wk.weight"), pre + "indexer.k_norm.weight")
        ik = self.kv_fp4(self.R(apply_rope(ik, cos, sin, c.rd)), index=True)
        ckv = self.kv_fp4(self.R(apply_rope(lat, cos, sin, c.rd)), index=False)
        shared["ckv"] = ckv
        shared["ik"] = ik.detach()
        shared["ratio"] = ratio

    def _index(self, lid, x, qr, pre, shared, tables):
        c = self.cfg
        B, S, _ = x.shape
        ratio = shared["ratio"]
        ik = shared["ik"]  # [B, T', dI]
        Tp = ik.shape[1]
        pos = torch.arange(S)
        vis = torch.arange(Tp)[None, :] < ((pos + 1) // ratio)[:, None]  # [S, T']
        if Tp == 0:
            shared["sel_idx"] = torch.zeros(B, S, 0, dtype=torch.long)
            shared["sel_valid"] = torch.zeros(B, S, 0, dtype=torch.bool)
            return
        with torch.no_grad():
            cos, sin = tables[1]
            ip = pre + "indexer."
            qi = self.qlinear(qr, ip + "wq_b.weight").view(B, S, c.idx_heads, c.idx_hd)
            qi = self.R(apply_rope(qi, cos, sin, c.rd))
            if self.numerics == "ref":
                qi = self.R(fp4_index(qi))
            wts = self.bf16_linear(x, ip + "weights_proj.weight")
            cw = c.idx_hd ** -0.5 * c.idx_heads ** -0.5
            if self.numerics == "ref":
                # torch (CPU) rounds a Python scalar to bf16 before it multiplies a bf16 tensor
                cw = float(torch.tensor(cw, dtype=torch.float32).to(torch.bfloat16))
            wts = self.R(wts * cw)
            if self.numerics == "ref":
                # q.k a bf16 matmul (oneDNN's pair order), bf16; the heads' terms summed in fp32
                # in head order from 0, then bf16
                s = torch.stack([matmul_ordered(qi[b], ik[b], pairs=True) for b in range(B)])
                s = bf16(torch.relu(bf16(s)) * wts.unsqueeze(-1))  # [B, S, heads, T']
                acc = torch.zeros_like(s[:, :, 0])
                for h in range(c.idx_heads):
                    acc = acc + s[:, :, h]
                score = bf16(acc)
            else:
                s = torch.bmm(qi.reshape(B, S * c.idx_heads, c.idx_hd), ik.transpose(1, 2))
                s = self.R(s.view(B, S, c.idx_heads, -1))
                s = self.R(torch.relu(s) * wts.unsqueeze(-1))
                score = s.sum(2)
            score = score.masked_fill(~vis, float("-inf"))
            if lid == c.cand_source:
                shared["cand"] = self._candidates(score, vis)
            elif lid > c.cand_source and "cand" in shared:
                score = score.masked_fill(~shared["cand"], float("-inf"))
            k = min(c.idx_topk, Tp)
            _, order = stable_topk_mask(score, k)
            shared["sel_idx"] = order
            shared["sel_valid"] = vis.unsqueeze(0).expand(B, S, Tp).gather(2, order)

    def _candidates(self, score, vis):
        c = self.cfg
        B, S, Tp = score.shape
        bs = c.cand_bs
        nb = -(-Tp // bs)
        padded = F.pad(score, (0, nb * bs - Tp), value=float("-inf"))
        bscore = padded.view(B, S, nb, bs).amax(-1)
        nvis = vis.sum(-1)  # [S]
        pin = ((nvis - 1).clamp_min(0) // bs)
        has = nvis > 0
        pinmask = F.one_hot(pin, nb).bool() & has[:, None]
        bscore = bscore.masked_fill(pinmask.unsqueeze(0), float("inf"))
        mask, _ = stable_topk_mask(bscore, min(c.cand_blocks, nb))
        mask = mask & (bscore > float("-inf"))
        pm = mask.unsqueeze(-1).expand(B, S, nb, bs).reshape(B, S, nb * bs)[..., :Tp]
        return pm

    # -- MoE
    def moe(self, x, pre, n_exp, topk, stats=None):
        c = self.cfg
        B, S, D = x.shape
        xf = x.reshape(-1, D)
        logits = self.f32_linear(xf, self.w(pre + "gate.weight"))
        sc = torch.sqrt(F.softplus(logits))
        bias = self.w(pre + "gate.bias").detach()
        _, idx = stable_topk_mask((sc + bias).detach(), topk)
        if getattr(self, "route_margins", None) is not None and topk < n_exp:
            # Gap between the last chosen and the first unchosen biased score, per token: a gap
            # below the two implementations' arithmetic difference is a routing near-tie.
            top = torch.topk((sc + bias).detach(), topk + 1, dim=-1).values
            self.route_margins.append((pre, (top[:, topk - 1] - top[:, topk]).view(B, S)))
        wsel = sc.gather(1, idx)
        if topk > 1:
            wsel = wsel / (wsel.sum(-1, keepdim=True) + 1e-20)
        wsel = wsel * c.route_scale
        if stats is not None:
            stats.append((pre, torch.bincount(idx.flatten(), minlength=n_exp).float()))
        out = torch.zeros_like(xf)
        for e in range(n_exp):
            hit = (idx == e)
            rows = hit.any(-1).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            rw = (wsel * hit).sum(-1)[rows].unsqueeze(-1)
            xe = xf[rows]
            ep = f"{pre}experts.{e}."
            g = self.qlinear(xe, ep + "w1.weight").clamp(max=c.swiglu)
            u = self.qlinear(xe, ep + "w3.weight").clamp(-c.swiglu, c.swiglu)
            hh = self.R(F.silu(g) * u * rw)
            out = out.index_add(0, rows, self.qlinear(hh, ep + "w2.weight"))
        sp = pre + "shared_experts."
        g = self.qlinear(xf, sp + "w1.weight").clamp(max=c.swiglu)
        u = self.qlinear(xf, sp + "w3.weight").clamp(-c.swiglu, c.swiglu)
        out = out + self.qlinear(self.R(F.silu(g) * u), sp + "w2.weight")
        return self.R(out).view(B, S, D)

    # -- Engram
    def engram(self, lid, h, rows):
        c = self.cfg
        pre = f"layers.{lid}.engram."
        B, S = rows.shape[:2]
        emb = self.w(pre + "embed.weight")[rows]  # [B, S, n, eg_hd]
        e = self.qlinear(self.R(emb.flatten(-2)), pre + "wkv.weight")
        key = e[..., :c.hc * c.D].reshape(B, S, c.hc, c.D)
        val = e[..., c.hc * c.D:]
        qk = self.w(pre + "q_weight") * self.w(pre + "k_weight")  # [hc, D]
        dot = (h * qk * key).sum(-1)
        if self.numerics == "ref":
            # the reference multiplies the two rsqrts first, then by fp32(D^-0.5)
            rstd = torch.rsqrt(h.pow(2).mean(-1) + c.eps) * torch.rsqrt(key.pow(2).mean(-1) + c.eps)
            dot = dot * rstd * c.D ** -0.5
        else:
            dot = dot * torch.rsqrt(h.pow(2).mean(-1) + c.eps) * torch.rsqrt(key.pow(2).mean(-1) + c.eps)
            dot = dot / math.sqrt(c.D)
        g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        return self.R(h + g.unsqueeze(-1) * val.unsqueeze(-2))

    # -- the whole prefill
    def forward(self, ids, engram_rows, debug=None, stats=None):
        """ids [B, S] (position 0 first); engram_rows {layer: LongTensor [B, S, n]}.

        Returns (logits [B, S, V] float32, main_hidden [B, S, n_targets * D])."""
        c = self.cfg
        B, S = ids.shape
        pos = torch.arange(S)
        ref = self.numerics == "ref"
        tables = (rope_tables(c, 0, pos, ref), rope_tables(c, 1, pos, ref))
        emb = self.w("embed.weight")[ids]
        h = emb.unsqueeze(2).expand(B, S, c.hc, c.D).contiguous()
        pre = torch.zeros(B, S, c.hc)
        pre[..., 0] = 1.0
        shared = {}
        taps = []
        for lid in range(c.L):
            lp = f"layers.{lid}."
            if lid in c.engram_layers:
                if debug is not None:
                    debug[f"engram_in_layer{lid}"] = h
                h = self.engram(lid, h, engram_rows[lid])
                if debug is not None:
                    debug[f"engram_out_layer{lid}"] = h
            if lid in c.targets:
                taps.append(self.R(h.mean(2)))
            aP, aQ, aC = self.mixes(h, lp + "hc_attn")
            xa = self.rmsnorm(self.hc_pre(h, pre), lp + "attn_norm.weight")
            ya = self.attention(lid, xa, lp + "attn.", shared, tables)
            if debug is not None:
                debug[f"attn_in_layer{lid}"] = xa
                debug[f"attn_out_layer{lid}"] = ya
            h = self.hc_post(ya, h, aQ, aC)
            fP, fQ, fC = self.mixes(h, lp + "hc_ffn")
            xf = self.rmsnorm(self.hc_pre(h, aP), lp + "ffn_norm.weight")
            yf = self.moe(xf, lp + "ffn.", c.n_exp, c.topk_exp, stats)
            if debug is not None:
                debug[f"ffn_in_layer{lid}"] = xf
                debug[f"ffn_out_layer{lid}"] = yf
            h = self.hc_post(yf, h, fQ, fC)
            pre = fP
        x = self.rmsnorm(self.hc_pre(h, pre), "norm.weight")
        if debug is not None:
            debug["final_norm"] = x
        logits = self.f32_linear(x, self.w("head.weight"))
        hidden = torch.cat(taps, dim=-1) if taps else None
        return logits, hidden


# ----------------------------------------------------------------------------- Engram hashing


class EngramHasher:
    """Row ids from engram_constants.json (model/engram_constants.h)."""

    def __init__(self, path_or_json):
        j = path_or_json
        if isinstance(j, str):
            with open(j) as f:
                j = json.load(f)
        self.j = j
        self.token_map = np.array(j["token_map"], np.int64) if "token_map" in j else None
        self.layers = j["layer_ids"]
        self.mult = np.array(j["multipliers"], np.int64)
        self.primes = j["primes"]
        self.offsets = j["offsets"]
        self.max_ngram = j["max_ngram_size"]
        self.pad = j["pad_id"]

    def rows(self, ids):
        """ids int array [B, S] -> {layer: int64 [B, S, (max_ngram-1)*heads]}"""
        ids = np.asarray(ids, np.int64)
        t0 = self.token_map[ids] if self.token_map is not None else ids
        B, S = t0.shape
        ts = []
        for s in range(self.max_ngram):
            t = np.full((B, S), self.pad, np.int64)
            if s < S:
                t[:, s:] = t0[:, :S - s]
            ts.append(t)
        out = {}
        with np.errstate(over="ignore"):
            for li, lid in enumerate(self.layers):
                m = self.mult[li]
                r = ts[0] * m[0]
                cols = []
                for n in range(2, self.max_ngram + 1):
                    r = r ^ (ts[n - 1] * m[n - 1])
                    for hh, p in enumerate(self.primes[li][n - 2]):
                        off = self.offsets[li][n - 2][hh]
                        cols.append(np.mod(r, p) + off)
                out[lid] = np.stack(cols, -1)
        return out
