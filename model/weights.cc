#include "model/weights.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "kernels/format.h"
#include "spdlog/spdlog.h"

namespace epd::model {
namespace {

namespace kf = kernels::format;

#define EPD_ASSIGN(lhs, expr)         \
  do {                                \
    auto _r = (expr);                 \
    if (!_r.ok()) return _r.status(); \
    lhs = std::move(*_r);             \
  } while (0)

class Loader {
 public:
  Loader(const TensorStore& s, kernels::Backend& backend) : s_(s), backend_(backend) {}

  // `bytes` host bytes copied into a new buffer in backend memory.
  absl::StatusOr<kernels::Buffer> Upload(const void* host, int64_t bytes) {
    auto b = backend_.Allocate(bytes);
    if (!b.ok()) return b.status();
    if (absl::Status st = backend_.Upload(host, bytes, *b); !st.ok()) return st;
    return std::move(*b);
  }

  // The bytes of a checkpoint tensor in backend memory, as they are.
  absl::StatusOr<kernels::Buffer> Put(const TensorView& t, int64_t bytes) {
    return Upload(t.data, bytes);
  }

  // Float values computed on the host, copied into backend memory.
  absl::StatusOr<WeightArray> Array(const std::vector<float>& values) {
    auto b = Upload(values.data(), static_cast<int64_t>(values.size() * sizeof(float)));
    if (!b.ok()) return b.status();
    return WeightArray(std::move(*b), static_cast<int64_t>(values.size()));
  }

  absl::StatusOr<WeightArray> Bf16(const std::string& name, std::vector<int64_t> shape) {
    auto v = s_.Get(name, DType::kBF16, shape);
    if (!v.ok()) return v.status();
    std::vector<float> out(v->numel());
    kf::Bf16BitsToF32N(v->data, v->numel(), out.data());
    return Array(out);
  }

  // A BF16 tensor that only plain linears and Embed read: its bf16 bits as they are.
  absl::StatusOr<WeightArray> Bf16Bits(const std::string& name, std::vector<int64_t> shape) {
    auto v = s_.Get(name, DType::kBF16, shape);
    if (!v.ok()) return v.status();
    auto b = Put(*v, v->bytes);
    if (!b.ok()) return b.status();
    return WeightArray(std::move(*b), v->numel(), kernels::PlainDtype::kBf16);
  }

  absl::StatusOr<WeightArray> F32(const std::string& name, std::vector<int64_t> shape) {
    auto v = s_.Get(name, DType::kF32, shape);
    if (!v.ok()) return v.status();
    std::vector<float> out(v->numel());
    std::memcpy(out.data(), v->data, v->bytes);
    return Array(out);
  }

  // A checkpoint tensor read in place (host-memory backend) or copied into device memory, whose
  // buffer `copy` then holds it.
  absl::StatusOr<TensorView> InPlace(const std::string& name, DType dtype,
                                     std::vector<int64_t> shape, kernels::Buffer* copy) {
    auto v = s_.Get(name, dtype, shape);
    if (!v.ok()) return v.status();
    if (backend_.memory_kind() == kernels::MemoryKind::kHost) return *v;
    auto b = Put(*v, v->bytes);
    if (!b.ok()) return b.status();
    *copy = std::move(*b);
    TensorView t = *v;
    t.data = copy->as<uint8_t>();
    return t;
  }

  absl::StatusOr<QuantWeight> Fp8(const std::string& prefix, int64_t out, int64_t in) {
    auto w = s_.Get(prefix + ".weight", DType::kF8E4M3, {out, in});
    if (!w.ok()) return w.status();
    auto s = s_.Get(prefix + ".scale", DType::kF8E8M0, {(out + 31) / 32, (in + 31) / 32});
    if (!s.ok()) return s.status();
    QuantWeight q;
    q.out = out;
    q.in = in;
    q.block_rows = 32;
    q.block_cols = 32;
    q.format = kernels::WeightFormat::kFp8E4M3;
    EPD_ASSIGN(q.codes, Put(*w, q.code_bytes()));
    EPD_ASSIGN(q.scale_codes, Put(*s, s->numel()));
    return q;
  }

  absl::StatusOr<QuantWeight> Fp4(const std::string& prefix, int64_t out, int64_t in) {
    auto w = s_.Get(prefix + ".weight", DType::kI8, {out, in / 2});
    if (!w.ok()) return w.status();
    auto s = s_.Get(prefix + ".scale", DType::kF8E8M0, {out, in / 32});
    if (!s.ok()) return s.status();
    QuantWeight q;
    q.out = out;
    q.in = in;
    q.block_rows = 1;
    q.block_cols = 32;
    q.format = kernels::WeightFormat::kFp4E2M1;
    EPD_ASSIGN(q.codes, Put(*w, q.code_bytes()));
    EPD_ASSIGN(q.scale_codes, Put(*s, s->numel()));
    return q;
  }

  // FP8 weight dequantized to its (bf16-exact) values, held as bf16 bits: wo_a, as convert.py
  // does.
  absl::StatusOr<WeightArray> Fp8Dequant(const std::string& prefix, int64_t out, int64_t in) {
    auto w = s_.Get(prefix + ".weight", DType::kF8E4M3, {out, in});
    if (!w.ok()) return w.status();
    const int64_t scols = (in + 31) / 32;
    auto s = s_.Get(prefix + ".scale", DType::kF8E8M0, {(out + 31) / 32, scols});
    if (!s.ok()) return s.status();
    std::vector<uint16_t> v(out * in);
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) {
        v[o * in + i] = kf::F32ToBf16Bits(kf::DecodeE4M3(w->data[o * in + i]) *
                                          kf::DecodeE8M0(s->data[(o / 32) * scols + i / 32]));
      }
    }
    auto b = Upload(v.data(), static_cast<int64_t>(v.size() * sizeof(uint16_t)));
    if (!b.ok()) return b.status();
    return WeightArray(std::move(*b), out * in, kernels::PlainDtype::kBf16);
  }

 private:
  const TensorStore& s_;
  kernels::Backend& backend_;
};

absl::Status LoadMoe(Loader& ld, const std::string& p, const ModelConfig& c, int n_experts,
                     int top_k, MoeWeights* m) {
  m->n_experts = n_experts;
  m->top_k = top_k;
  EPD_ASSIGN(m->gate, ld.Bf16Bits(p + "gate.weight", {n_experts, c.dim}));
  EPD_ASSIGN(m->gate_bias, ld.F32(p + "gate.bias", {n_experts}));
  m->experts.resize(n_experts);
  for (int e = 0; e < n_experts; ++e) {
    const std::string ep = absl::StrCat(p, "experts.", e, ".");
    EPD_ASSIGN(m->experts[e].w1, ld.Fp4(ep + "w1", c.moe_inter_dim, c.dim));
    EPD_ASSIGN(m->experts[e].w3, ld.Fp4(ep + "w3", c.moe_inter_dim, c.dim));
    EPD_ASSIGN(m->experts[e].w2, ld.Fp4(ep + "w2", c.dim, c.moe_inter_dim));
  }
  if (c.n_shared_experts > 0) {
    m->shared.resize(1);
    const int64_t inter = c.moe_inter_dim * c.n_shared_experts;
    EPD_ASSIGN(m->shared[0].w1, ld.Fp8(p + "shared_experts.w1", inter, c.dim));
    EPD_ASSIGN(m->shared[0].w3, ld.Fp8(p + "shared_experts.w3", inter, c.dim));
    EPD_ASSIGN(m->shared[0].w2, ld.Fp8(p + "shared_experts.w2", c.dim, inter));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelWeights>> ModelWeights::Load(
    const ModelConfig& c, std::shared_ptr<const TensorStore> store, kernels::Backend* backend) {
  auto mw = std::make_unique<ModelWeights>();
  mw->store = store;
  std::unique_ptr<kernels::Backend> host;
  if (backend == nullptr) {
    host = kernels::MakeCpuBackend();  // host memory; its buffers do not need the backend object
    backend = host.get();
  }
  Loader ld(*store, *backend);
  EPD_ASSIGN(mw->embed, ld.Bf16Bits("embed.weight", {c.vocab_size, c.dim}));
  EPD_ASSIGN(mw->head, ld.Bf16Bits("head.weight", {c.vocab_size, c.dim}));
  EPD_ASSIGN(mw->norm, ld.Bf16("norm.weight", {c.dim}));
  const std::vector<LayerRole> roles = c.Roles();
  mw->layers.resize(c.total_layers());
  const int64_t hc = c.hc_mult, nmix = (2 + hc) * hc;
  for (int l = 0; l < c.total_layers(); ++l) {
    const LayerRole& r = roles[l];
    const std::string p = r.is_dspark_stage ? absl::StrCat("mtp.", l - c.n_layers, ".")
                                            : absl::StrCat("layers.", l, ".");
    LayerWeights& L = mw->layers[l];
    AttentionWeights& A = L.attn;
    EPD_ASSIGN(L.attn_norm, ld.Bf16(p + "attn_norm.weight", {c.dim}));
    EPD_ASSIGN(L.ffn_norm, ld.Bf16(p + "ffn_norm.weight", {c.dim}));
    EPD_ASSIGN(A.attn_sink, ld.F32(p + "attn.attn_sink", {c.n_heads}));
    EPD_ASSIGN(A.q_norm, ld.Bf16(p + "attn.q_norm.weight", {c.q_lora_rank}));
    EPD_ASSIGN(A.kv_norm, ld.Bf16(p + "attn.kv_norm.weight", {c.head_dim}));
    EPD_ASSIGN(A.wq_a, ld.Fp8(p + "attn.wq_a", c.q_lora_rank, c.dim));
    EPD_ASSIGN(A.wq_b, ld.Fp8(p + "attn.wq_b", int64_t{c.n_heads} * c.head_dim, c.q_lora_rank));
    EPD_ASSIGN(A.wkv, ld.Fp8(p + "attn.wkv", c.head_dim, c.dim));
    EPD_ASSIGN(A.wo_a, ld.Fp8Dequant(p + "attn.wo_a", c.o_groups * c.o_lora_rank,
                                     int64_t{c.n_heads / c.o_groups} * c.head_dim));
    EPD_ASSIGN(A.wo_b, ld.Fp8(p + "attn.wo_b", c.dim, c.o_groups * c.o_lora_rank));
    if (r.is_kv_source) {
      EPD_ASSIGN(A.cmp_wkv, ld.Bf16Bits(p + "attn.compressor.wkv.weight", {c.head_dim, c.dim}));
      if (r.has_wgate)
        EPD_ASSIGN(A.cmp_wgate,
                   ld.Bf16Bits(p + "attn.compressor.wgate.weight", {c.head_dim, c.dim}));
      EPD_ASSIGN(A.cmp_norm, ld.Bf16(p + "attn.compressor.norm.weight", {c.head_dim}));
      EPD_ASSIGN(A.idx_wk,
                 ld.Bf16Bits(p + "attn.indexer.wk.weight", {c.index_head_dim, c.head_dim}));
      EPD_ASSIGN(A.idx_k_norm, ld.Bf16(p + "attn.indexer.k_norm.weight", {c.index_head_dim}));
    }
    if (r.is_index_source) {
      EPD_ASSIGN(A.idx_wq_b, ld.Fp8(p + "attn.indexer.wq_b",
                                    int64_t{c.index_n_heads} * c.index_head_dim, c.q_lora_rank));
      EPD_ASSIGN(A.idx_weights_proj,
                 ld.Bf16Bits(p + "attn.indexer.weights_proj.weight", {c.index_n_heads, c.dim}));
    }
    const int ne = r.is_dspark_stage ? c.dspark_n_routed_experts : c.n_routed_experts;
    const int tk = r.is_dspark_stage ? c.dspark_n_activated_experts : c.n_activated_experts;
    if (absl::Status s = LoadMoe(ld, p + "ffn.", c, ne, tk, &L.ffn); !s.ok()) return s;
    EPD_ASSIGN(L.hc_attn_fn, ld.F32(p + "hc_attn_fn", {nmix, hc * c.dim}));
    EPD_ASSIGN(L.hc_attn_base, ld.F32(p + "hc_attn_base", {nmix}));
    EPD_ASSIGN(L.hc_attn_scale, ld.F32(p + "hc_attn_scale", {3}));
    EPD_ASSIGN(L.hc_ffn_fn, ld.F32(p + "hc_ffn_fn", {nmix, hc * c.dim}));
    EPD_ASSIGN(L.hc_ffn_base, ld.F32(p + "hc_ffn_base", {nmix}));
    EPD_ASSIGN(L.hc_ffn_scale, ld.F32(p + "hc_ffn_scale", {3}));
    if (r.has_engram) {
      size_t ei = 0;
      while (c.engram_layer_ids[ei] != l) ++ei;
      auto e = std::make_unique<EngramWeights>();
      const int64_t rows = c.engram_num_embeddings[ei];
      EPD_ASSIGN(e->table, ld.InPlace(p + "engram.embed.weight", DType::kF8E4M3,
                                      {rows, c.engram_head_dim}, &e->table_copy));
      EPD_ASSIGN(e->table_scale, ld.InPlace(p + "engram.embed.scale", DType::kF8E8M0,
                                            {rows, c.engram_head_dim / 32}, &e->table_scale_copy));
      const int64_t in =
          int64_t{c.engram_max_ngram_size - 1} * c.engram_n_heads * c.engram_head_dim;
      EPD_ASSIGN(e->wkv, ld.Fp8(p + "engram.wkv", (hc + 1) * c.dim, in));
      EPD_ASSIGN(e->q_weight, ld.Bf16(p + "engram.q_weight", {hc, c.dim}));
      EPD_ASSIGN(e->k_weight, ld.Bf16(p + "engram.k_weight", {hc, c.dim}));
      L.engram = std::move(e);
    }
    spdlog::debug("loaded layer {} ({})", l, LayerModeName(r.mode));
  }
  if (c.n_mtp_layers > 0) {
    auto d = std::make_unique<DSparkWeights>();
    const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
    const std::string last = absl::StrCat("mtp.", c.n_mtp_layers - 1, ".");
    EPD_ASSIGN(d->main_proj, ld.Fp8("mtp.0.main_proj", c.dim, nt * c.dim));
    EPD_ASSIGN(d->main_norm, ld.Bf16("mtp.0.main_norm.weight", {c.dim}));
    EPD_ASSIGN(d->norm, ld.Bf16(last + "norm.weight", {c.dim}));
    EPD_ASSIGN(d->markov_embed, ld.Bf16Bits(last + "markov_head.embed.weight",
                                            {c.vocab_size, c.dspark_markov_rank}));
    EPD_ASSIGN(d->markov_head,
               ld.Bf16Bits(last + "markov_head.head.weight", {c.vocab_size, c.dspark_markov_rank}));
    EPD_ASSIGN(d->confidence, ld.Bf16Bits(last + "confidence_head.proj.weight",
                                          {1, c.dim + c.dspark_markov_rank}));
    mw->dspark = std::move(d);
  }
  spdlog::info("weights loaded: {} layers, {:.1f} MB checkpoint", c.total_layers(),
               store->total_bytes() / 1e6);
  return mw;
}

const float* WeightArray::data() const {
  if (dtype_ != kernels::PlainDtype::kF32) {
    std::fprintf(stderr, "WeightArray::data(): a bf16 array has no float view; use plain()\n");
    std::abort();
  }
  return size_ == 0 ? nullptr : buffer_.as<float>();
}

int64_t ModelWeights::ResidentBytes() const {
  int64_t n = 0;
  ForEachPiece([&](const Piece& p) { n += p.bytes; });
  return n;
}

void ModelWeights::ForEachPiece(const std::function<void(const Piece&)>& fn) const {
  auto array = [&](const std::string& name, const WeightArray& v) {
    if (!v.empty()) fn({name, v.plain().data, v.bytes(), v.kind()});
  };
  auto quant = [&](const std::string& name, const QuantWeight& w) {
    if (w.packed()) {
      fn({name + ".codes", w.codes.data(), w.codes.bytes(), w.codes.kind()});
      fn({name + ".scale", w.scale_codes.data(), w.scale_codes.bytes(), w.scale_codes.kind()});
    } else if (!w.values.empty()) {
      const auto f = static_cast<int64_t>(sizeof(float));
      fn({name + ".values", w.values.data(), static_cast<int64_t>(w.values.size()) * f,
          kernels::MemoryKind::kHost});
      fn({name + ".scales", w.scales.data(), static_cast<int64_t>(w.scales.size()) * f,
          kernels::MemoryKind::kHost});
    }
  };
  auto expert = [&](const std::string& p, const ExpertWeights& e) {
    quant(p + "w1", e.w1);
    quant(p + "w2", e.w2);
    quant(p + "w3", e.w3);
  };
  array("embed", embed);
  array("head", head);
  array("norm", norm);
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerWeights& L = layers[l];
    const std::string p = absl::StrCat("layers.", l, ".");
    array(p + "attn_norm", L.attn_norm);
    array(p + "ffn_norm", L.ffn_norm);
    array(p + "hc_attn_fn", L.hc_attn_fn);
    array(p + "hc_attn_base", L.hc_attn_base);
    array(p + "hc_attn_scale", L.hc_attn_scale);
    array(p + "hc_ffn_fn", L.hc_ffn_fn);
    array(p + "hc_ffn_base", L.hc_ffn_base);
    array(p + "hc_ffn_scale", L.hc_ffn_scale);
    const AttentionWeights& A = L.attn;
    array(p + "attn.attn_sink", A.attn_sink);
    array(p + "attn.q_norm", A.q_norm);
    array(p + "attn.kv_norm", A.kv_norm);
    quant(p + "attn.wq_a", A.wq_a);
    quant(p + "attn.wq_b", A.wq_b);
    quant(p + "attn.wkv", A.wkv);
    array(p + "attn.wo_a", A.wo_a);
    quant(p + "attn.wo_b", A.wo_b);
    array(p + "attn.compressor.wkv", A.cmp_wkv);
    array(p + "attn.compressor.wgate", A.cmp_wgate);
    array(p + "attn.compressor.norm", A.cmp_norm);
    array(p + "attn.indexer.wk", A.idx_wk);
    array(p + "attn.indexer.k_norm", A.idx_k_norm);
    quant(p + "attn.indexer.wq_b", A.idx_wq_b);
    array(p + "attn.indexer.weights_proj", A.idx_weights_proj);
    array(p + "ffn.gate", L.ffn.gate);
    array(p + "ffn.gate_bias", L.ffn.gate_bias);
    for (size_t e = 0; e < L.ffn.experts.size(); ++e)
      expert(absl::StrCat(p, "ffn.experts.", e, "."), L.ffn.experts[e]);
    for (size_t e = 0; e < L.ffn.shared.size(); ++e)
      expert(absl::StrCat(p, "ffn.shared_experts.", e, "."), L.ffn.shared[e]);
    if (L.engram) {
      const EngramWeights& E = *L.engram;
      // Read in place from the checkpoint's mapping (host) unless copied into the backend.
      fn({p + "engram.embed", E.table.data, E.table.bytes,
          E.table_copy.empty() ? kernels::MemoryKind::kHost : E.table_copy.kind()});
      fn({p + "engram.embed_scale", E.table_scale.data, E.table_scale.bytes,
          E.table_scale_copy.empty() ? kernels::MemoryKind::kHost : E.table_scale_copy.kind()});
      quant(p + "engram.wkv", E.wkv);
      array(p + "engram.q_weight", E.q_weight);
      array(p + "engram.k_weight", E.k_weight);
    }
  }
  if (dspark) {
    const DSparkWeights& d = *dspark;
    quant("mtp.main_proj", d.main_proj);
    array("mtp.main_norm", d.main_norm);
    array("mtp.norm", d.norm);
    array("mtp.markov_embed", d.markov_embed);
    array("mtp.markov_head", d.markov_head);
    array("mtp.confidence", d.confidence);
  }
}

}  // namespace epd::model
