"""The DSpark draft pass (MODEL.md §3 "DSpark", model/model.cc Model::Draft) in PyTorch, batched
over every draft position of a sequence at once, for training the `mtp.*` stages (issue 18).

At a decode position p (the last position the main model processed) the C++ engine drafts from:
  - the stages' window rings: per stage s, FP8(RoPE_p(kv_norm(wkv_s(main_x_q)))) for the main
    positions q = max(0, p-127) .. p, where main_x = main_norm(main_proj(main_hidden)) and
    main_hidden is the concat of the main model's target-layer taps (v41.V41.forward's `hidden`);
  - a block of 5 ids [x_{p+1}, noise x 4] at positions p+1 .. p+5 (x_{p+1}: the token the main
    model sampled at p), embedded, copied into the mHC streams, one-hot pre-mix;
  - three SWA blocks (mixes, attention over the ring + all 5 block rows without a causal mask,
    MoE 4 experts top-3); each stage's FFN pre-mix is the next stage's attention pre-mix;
  - head: x = hc_pre(h, pre); logits_i = head(mtp.2.norm(x_i)) + markov_head(markov_embed(c_i))
    with c_0 = x_{p+1} and c_i = the draft chain's previous token; confidence_i =
    confidence_head.proj(concat(x_i, markov_embed(c_i))).

`draft_forward` computes that for every p of a [B, S] batch in one pass: query block p attends
to ring entries p-127..p (the causal window) and to its own 5 rows.
"""

import torch

import v41


def main_x(m, hidden):
    """hidden [..., n_targets * D] -> main_x [..., D] (mtp.0.main_proj + main_norm)."""
    return m.rmsnorm(m.qlinear(hidden, "mtp.0.main_proj.weight"), "mtp.0.main_norm.weight")


def stage_kv(m, pre, x, cos, sin):
    """Model::StageKv: FP8(RoPE(kv_norm(wkv(x)))) at the positions of cos/sin."""
    c = m.cfg
    kv = m.rmsnorm(m.qlinear(x, pre + "attn.wkv.weight"), pre + "attn.kv_norm.weight")
    return m.kv_fp8(m.R(v41.apply_rope(kv, cos, sin, c.rd)))


def draft_forward(m, hidden, chain, seg=None):
    """hidden [B, S, n_t*D] main taps; chain [B, S, 5] ids c_i (c_0 = x_{p+1}, c_i = x_{p+1+i});
    seg [B, S] (optional): sequence id of each position when several sequences are packed into
    one row (a draft at p then sees only ring entries of its own sequence).

    Returns (logits [B, S, 5, V] markov bias included, x [B, S, 5, D] head input (un-normed),
    e [B, S, 5, R] markov embeddings of the chain)."""
    c = m.cfg
    B, S, _ = hidden.shape
    NB = c.raw["text_config"]["dspark_block_size"]
    noise = c.raw["text_config"]["dspark_noise_token_id"]
    hc, D, H, hd = c.hc, c.D, c.H, c.hd
    mx = main_x(m, hidden)  # [B, S, D]
    pos = torch.arange(S)
    rcos, rsin = v41.rope_tables(c, 0, pos)  # ring: position p
    qpos = (pos[:, None] + 1 + torch.arange(NB)[None, :]).reshape(-1)
    qcos, qsin = v41.rope_tables(c, 0, qpos)
    qcos, qsin = qcos.view(S, NB, -1), qsin.view(S, NB, -1)
    block = torch.full((B, S, NB), noise, dtype=torch.long)
    block[..., 0] = chain[..., 0]
    emb = m.w("embed.weight")[block]  # [B, S, NB, D]
    h = emb.unsqueeze(3).expand(B, S, NB, hc, D).contiguous()
    pre = torch.zeros(B, S, NB, hc)
    pre[..., 0] = 1.0
    i = pos[:, None]
    j = pos[None, :]
    rmask = ((j <= i) & (j > i - c.window)).unsqueeze(0)  # [1 or B, S(p), S(q)]
    if seg is not None:
        rmask = rmask & (seg[:, :, None] == seg[:, None, :])
    scale = hd ** -0.5
    for s in range(c.n_mtp):
        sp = f"mtp.{s}."
        aP, aQ, aC = m.mixes(h, sp + "hc_attn")
        x = m.rmsnorm(m.hc_pre(h, pre), sp + "attn_norm.weight")  # [B, S, NB, D]
        qr = m.rmsnorm(m.qlinear(x, sp + "attn.wq_a.weight"), sp + "attn.q_norm.weight")
        q = m.qlinear(qr, sp + "attn.wq_b.weight").view(B, S, NB, H, hd)
        q = m.R(v41.apply_rope(q, qcos, qsin, c.rd))
        dkv = stage_kv(m, sp, x, qcos, qsin)  # [B, S, NB, hd]
        rkv = stage_kv(m, sp, mx, rcos, rsin)  # [B, S, hd]
        # ring scores [B, S, NB, H, S]
        sr = torch.einsum("bpnhd,bqd->bpnhq", q, rkv) * scale
        sr = sr.masked_fill(~rmask[:, :, None, None, :], float("-inf"))
        sd = torch.einsum("bpnhd,bpkd->bpnhk", q, dkv) * scale  # [B, S, NB, H, NB]
        sall = torch.cat([sr, sd], dim=-1)
        sink = m.w(sp + "attn.attn_sink").view(1, 1, 1, H, 1)
        mxs = torch.maximum(sall.amax(-1, keepdim=True), sink).detach()
        pr = torch.exp(sall - mxs)
        den = pr.sum(-1, keepdim=True) + torch.exp(sink - mxs)
        if m.numerics == "ref":
            pr = v41.bf16(pr)
        o = torch.einsum("bpnhq,bqd->bpnhd", pr[..., :S], rkv)
        o = o + torch.einsum("bpnhk,bpkd->bpnhd", pr[..., S:], dkv)
        o = m.R(o / den)
        o = m.R(v41.apply_rope(o, qcos, qsin, c.rd, inverse=True))
        og = o.reshape(B * S * NB, c.G, H * hd // c.G)
        wo_a = m.w(sp + "attn.wo_a.weight").view(c.G, c.ol, H * hd // c.G)
        if m.numerics == "ref":
            wo_a = v41.bf16(wo_a)
        ya = m.R(torch.einsum("ngi,gri->ngr", og, wo_a)).reshape(B, S, NB, c.G * c.ol)
        ya = m.qlinear(ya, sp + "attn.wo_b.weight")
        h = m.hc_post(ya, h, aQ, aC)
        fP, fQ, fC = m.mixes(h, sp + "hc_ffn")
        xf = m.rmsnorm(m.hc_pre(h, aP), sp + "ffn_norm.weight")
        yf = m.moe(xf.reshape(B, S * NB, D), sp + "ffn.", c.dspark_exp, c.dspark_topk,
                   getattr(m, "dspark_stats", None)).view(B, S, NB, D)
        h = m.hc_post(yf, h, fQ, fC)
        pre = fP
    x = m.hc_pre(h, pre)
    logits = m.rmsnorm(x, "mtp.2.norm.weight") @ m.w("head.weight").t()
    e = m.w("mtp.2.markov_head.embed.weight")[chain]  # [B, S, NB, R]
    if m.numerics == "ref":
        e = v41.bf16(e)
    logits = logits + e @ m.w("mtp.2.markov_head.head.weight").t()
    return logits, x, e


def confidence(m, x, e):
    """confidence_head.proj(concat(x, e)) -> [..., NB] raw logits (no sigmoid, as the engine)."""
    cat = torch.cat([x, e], dim=-1)
    return (cat @ m.w("mtp.2.confidence_head.proj.weight").t()).squeeze(-1)
