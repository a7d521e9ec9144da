#include "model/nano/nano_generator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/bpe_trainer.h"
#include "model/engram_constants.h"
#include "model/safetensors_writer.h"
#include "tokenizer/tokenizer.h"

namespace epd::model {
namespace {

using json = nlohmann::json;

// ----------------------------------------------------------------------------- number formats

const std::vector<double>& E2m1Table() {
  static const std::vector<double> t = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  return t;
}

// |a| -> nearest code in an ascending magnitude table, ties to the even code.
uint8_t NearestCode(double a, const std::vector<double>& table) {
  const auto n = static_cast<int64_t>(table.size());
  int64_t idx = std::lower_bound(table.begin(), table.end(), a) - table.begin();
  idx = std::clamp<int64_t>(idx, 1, n - 1);
  const double lo = table[static_cast<size_t>(idx - 1)], hi = table[static_cast<size_t>(idx)];
  const bool up = (a - lo > hi - a) || ((a - lo == hi - a) && (idx % 2 == 0));
  return static_cast<uint8_t>(up ? idx : idx - 1);
}

// |v| <= 448 -> E4M3 code, round to nearest, ties to the even code. Same result as
// a nearest search over the 127 E4M3 magnitudes (the code's low bit is the rounded mantissa's;
// checked on every midpoint and 1e7 random values), about 10x faster.
uint8_t E4m3Encode(double v) {
  const double a = std::fabs(v);
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  if (a < 0.015625) {  // subnormal range (< 2^-6): step 2^-9, code = rounded mantissa
    return static_cast<uint8_t>(static_cast<int>(std::nearbyint(a * 512.0)) | sign);
  }
  int x = 0;
  std::frexp(a, &x);  // a in [2^(x-1), 2^x)
  const int e = x - 1;
  const int r = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - e)));  // 8..16 (16 carries)
  return static_cast<uint8_t>((((e + 7) << 3) + (r - 8)) | sign);
}
uint8_t E2m1Encode(double v) {
  return static_cast<uint8_t>(NearestCode(std::fabs(v), E2m1Table()) | (std::signbit(v) ? 0x8 : 0));
}

// ceil(log2(r)) via frexp, as the golden generator.
int CeilLog2(double r) {
  int e = 0;
  const double m = std::frexp(r, &e);
  return m == 0.5 ? e - 1 : e;
}

uint16_t Bf16Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((static_cast<uint64_t>(b) + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// f(begin, end) over [0, n) split into `threads` contiguous ranges, each on a thread of its own
// (threads <= 1: one call on this thread).
template <typename F>
void ParallelFor(int64_t n, int threads, F&& f) {
  if (threads <= 1 || n < 2) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t parts = std::min<int64_t>(threads, n);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < parts; ++t) {
    pool.emplace_back([&, t] { f(n * t / parts, n * (t + 1) / parts); });
  }
  for (auto& th : pool) th.join();
}

// splitmix64's finalizer: a chunk's seed from the builder's seed, the call and the chunk.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ----------------------------------------------------------------------------- checkpoint builder

class Builder {
 public:
  // threads > 1: every Normal draws its values in chunks of kChunk, each from a generator seeded by
  // (seed, the call, the chunk), on `threads` threads, and the quantizers split their rows over
  // them. The bytes then depend on the seed only (not on the thread count), but differ from the
  // one-thread builder's (one generator for everything, as the nano model is made).
  explicit Builder(uint64_t seed, int threads = 1)
      : rng_(seed), seed_(seed), threads_(std::max(1, threads)) {}

  // Deterministic approximate N(0, std): Irwin-Hall sum of 12 uniforms (21-bit, three per PCG64
  // output) minus 6. Integer sums and IEEE arithmetic only (no libm), so the bytes are the same on
  // every platform. Not NumPy's ziggurat: bytes differ from the Python generator, the scales and
  // quantization conventions do not. Tails are cut at 6 sigma (irrelevant for random weights).
  std::vector<float> Normal(size_t n, double std, double mean = 0.0) {
    std::vector<float> v(n);
    auto fill = [&](NumpyPcg64& rng, size_t from, size_t to) {
      for (size_t i = from; i < to; ++i) {
        uint64_t sum = 0;
        for (int k = 0; k < 4; ++k) {
          const uint64_t r = rng.NextUint64();
          sum += (r & 0x1FFFFF) + ((r >> 21) & 0x1FFFFF) + ((r >> 42) & 0x1FFFFF);
        }
        const double z = (static_cast<double>(sum) + 6.0) * (1.0 / 2097152.0) - 6.0;
        v[i] = static_cast<float>(mean + std * z);
      }
    };
    if (threads_ == 1) {
      fill(rng_, 0, n);
      return v;
    }
    const uint64_t call = ++calls_;
    const auto chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
    ParallelFor(chunks, threads_, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        NumpyPcg64 rng(Mix64(seed_ ^ Mix64((call << 32) + static_cast<uint64_t>(c))));
        fill(rng, static_cast<size_t>(c) * kChunk,
             std::min(n, static_cast<size_t>(c + 1) * kChunk));
      }
    });
    return v;
  }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * rng_.NextDouble(); }

  absl::Status Bf16(const std::string& name, const std::vector<int64_t>& shape,
                    const std::vector<float>& a) {
    std::string raw(a.size() * 2, '\0');
    for (size_t i = 0; i < a.size(); ++i) {
      const uint16_t b = Bf16Bits(a[i]);
      raw[2 * i] = static_cast<char>(b & 0xFF);
      raw[2 * i + 1] = static_cast<char>(b >> 8);
    }
    return w_.Add(name, "BF16", shape, std::move(raw));
  }
  absl::Status F32(const std::string& name, const std::vector<int64_t>& shape,
                   const std::vector<float>& a) {
    std::string raw(a.size() * 4, '\0');
    std::memcpy(raw.data(), a.data(), raw.size());  // little-endian host
    return w_.Add(name, "F32", shape, std::move(raw));
  }
  absl::Status Norm(const std::string& name, int64_t n) {
    return Bf16(name, {n}, Normal(static_cast<size_t>(n), 0.1, 1.0));
  }

  // w [O, I] -> E4M3 [O, I] + E8M0 [ceil(O/bo), ceil(I/bi)] (power-of-two ceil of amax/448).
  absl::Status Fp8Blockwise(const std::string& prefix, const std::string& scale_name, int64_t O,
                            int64_t I, const std::vector<float>& w, int64_t bo, int64_t bi) {
    const int64_t nO = (O + bo - 1) / bo, nI = (I + bi - 1) / bi;
    std::string codes(static_cast<size_t>(O * I), '\0');
    std::string scales(static_cast<size_t>(nO * nI), '\0');
    ParallelFor(nO, threads_, [&](int64_t o0, int64_t o1) {
      for (int64_t bo_i = o0; bo_i < o1; ++bo_i) {
        for (int64_t bi_i = 0; bi_i < nI; ++bi_i) {
          double amax = 0;
          for (int64_t r = bo_i * bo; r < std::min(O, (bo_i + 1) * bo); ++r)
            for (int64_t c = bi_i * bi; c < std::min(I, (bi_i + 1) * bi); ++c)
              amax =
                  std::max(amax, static_cast<double>(std::fabs(w[static_cast<size_t>(r * I + c)])));
          amax = std::max(amax, 1e-30);
          const int ex = CeilLog2(amax / 448.0);
          scales[static_cast<size_t>(bo_i * nI + bi_i)] = static_cast<char>(ex + 127);
          const double inv = std::ldexp(1.0, -ex);
          for (int64_t r = bo_i * bo; r < std::min(O, (bo_i + 1) * bo); ++r)
            for (int64_t c = bi_i * bi; c < std::min(I, (bi_i + 1) * bi); ++c)
              codes[static_cast<size_t>(r * I + c)] = static_cast<char>(
                  E4m3Encode(static_cast<double>(w[static_cast<size_t>(r * I + c)]) * inv));
        }
      }
    });
    RETURN_IF_ERROR(w_.Add(prefix + ".weight", "F8_E4M3", {O, I}, std::move(codes)));
    return w_.Add(scale_name, "F8_E8M0", {nO, nI}, std::move(scales));
  }

  absl::Status Fp8Linear(const std::string& prefix, int64_t out_f, int64_t in_f,
                         double gain = 1.0) {
    auto w = Normal(static_cast<size_t>(out_f * in_f), gain / std::sqrt(static_cast<double>(in_f)));
    return Fp8Blockwise(prefix, prefix + ".scale", out_f, in_f, w, 32, 32);
  }

  // MXFP4: I8 [out, in/2] (low nibble = even element) + E8M0 [out, in/32].
  absl::Status Fp4Linear(const std::string& prefix, int64_t out_f, int64_t in_f,
                         double gain = 1.0) {
    if (in_f % 32 != 0)
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ": in_features ", in_f, " not a multiple of 32"));
    auto w = Normal(static_cast<size_t>(out_f * in_f), gain / std::sqrt(static_cast<double>(in_f)));
    std::string packed(static_cast<size_t>(out_f * in_f / 2), '\0');
    std::string scales(static_cast<size_t>(out_f * in_f / 32), '\0');
    ParallelFor(out_f, threads_, [&](int64_t r0, int64_t r1) {
      std::vector<uint8_t> codes(static_cast<size_t>(in_f));
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t b = 0; b < in_f / 32; ++b) {
          double amax = 0;
          for (int64_t k = 0; k < 32; ++k)
            amax = std::max(amax, static_cast<double>(
                                      std::fabs(w[static_cast<size_t>(r * in_f + b * 32 + k)])));
          amax = std::max(amax, 1e-30);
          const int ex = CeilLog2(amax / 6.0);
          scales[static_cast<size_t>(r * (in_f / 32) + b)] = static_cast<char>(ex + 127);
          const double inv = std::ldexp(1.0, -ex);
          for (int64_t k = 0; k < 32; ++k)
            codes[static_cast<size_t>(b * 32 + k)] = E2m1Encode(
                static_cast<double>(w[static_cast<size_t>(r * in_f + b * 32 + k)]) * inv);
        }
        for (int64_t k = 0; k < in_f / 2; ++k)
          packed[static_cast<size_t>(r * (in_f / 2) + k)] = static_cast<char>(
              codes[static_cast<size_t>(2 * k)] | (codes[static_cast<size_t>(2 * k + 1)] << 4));
      }
    });
    RETURN_IF_ERROR(w_.Add(prefix + ".weight", "I8", {out_f, in_f / 2}, std::move(packed)));
    return w_.Add(prefix + ".scale", "F8_E8M0", {out_f, in_f / 32}, std::move(scales));
  }

  absl::Status EngramTable(const std::string& prefix, int64_t rows, int64_t d) {
    auto w = Normal(static_cast<size_t>(rows * d), 1.0);
    return Fp8Blockwise(prefix, prefix + ".scale", rows, d, w, 1, 32);
  }

  SafetensorsWriter& writer() { return w_; }

 private:
  static constexpr size_t kChunk = size_t{1} << 20;
  NumpyPcg64 rng_;
  const uint64_t seed_;
  const int threads_;
  uint64_t calls_ = 0;  // Normal calls (threads > 1: part of each chunk's seed)
  SafetensorsWriter w_;
};

struct Dims {
  int64_t V, D, H, hd, ql, G, ol, inter, hc, n_exp, n_dspark_exp, idx_hd, idx_heads, eg_heads,
      eg_hd, eg_ngram, markov, L, n_mtp, n_targets;
  std::vector<int64_t> ratios, kv_sources, index_sources, engram_layers, engram_rows;
};

absl::StatusOr<Dims> ParseDims(const json& config) {
  const json& tc = config.contains("text_config") ? config["text_config"] : config;
  Dims d;
  try {
    auto get = [&](const char* k) -> int64_t {
      if (!tc.contains(k)) throw std::out_of_range(k);
      return tc[k].get<int64_t>();
    };
    auto vec = [&](const char* k) -> std::vector<int64_t> {
      if (!tc.contains(k)) throw std::out_of_range(k);
      return tc[k].get<std::vector<int64_t>>();
    };
    d.V = get("vocab_size");
    d.D = get("hidden_size");
    d.H = get("num_attention_heads");
    d.hd = get("head_dim");
    d.ql = get("q_lora_rank");
    d.G = get("o_groups");
    d.ol = get("o_lora_rank");
    d.inter = get("moe_intermediate_size");
    d.hc = get("hc_mult");
    d.n_exp = get("n_routed_experts");
    d.n_dspark_exp = get("dspark_n_routed_experts");
    d.idx_hd = get("index_head_dim");
    d.idx_heads = get("index_n_heads");
    d.eg_heads = get("engram_n_heads");
    d.eg_hd = get("engram_head_dim");
    d.eg_ngram = get("engram_max_ngram_size");
    d.markov = get("dspark_markov_rank");
    d.L = get("num_hidden_layers");
    d.n_mtp = get("num_nextn_predict_layers");
    d.n_targets = static_cast<int64_t>(vec("dspark_target_layer_ids").size());
    d.ratios = vec("compress_ratios");
    d.kv_sources = vec("kv_source_layer_ids");
    d.index_sources = vec("index_source_layer_ids");
    d.engram_layers = vec("engram_layer_ids");
    d.engram_rows = vec("engram_num_embeddings");
  } catch (const std::out_of_range& e) {
    return absl::InvalidArgumentError(absl::StrCat("config text_config lacks \"", e.what(), "\""));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("config field has the wrong type: ", e.what()));
  }
  if (static_cast<int64_t>(d.ratios.size()) != d.L + d.n_mtp) {
    return absl::InvalidArgumentError(absl::StrCat("compress_ratios has ", d.ratios.size(),
                                                   " entries, expected ", d.L + d.n_mtp,
                                                   " (layers + DSpark stages)"));
  }
  if (d.engram_rows.size() != d.engram_layers.size()) {
    return absl::InvalidArgumentError(
        "engram_num_embeddings and engram_layer_ids differ in length");
  }
  for (int64_t v : {d.V, d.D, d.H, d.hd, d.ql, d.G, d.ol, d.inter, d.hc, d.n_exp, d.n_dspark_exp,
                    d.idx_hd, d.idx_heads, d.eg_heads, d.eg_hd, d.markov, d.L}) {
    if (v <= 0) return absl::InvalidArgumentError("config dimensions must be positive");
  }
  if (d.D % 32 != 0 || d.inter % 32 != 0 || (d.H * d.hd) % d.G != 0) {
    return absl::InvalidArgumentError(
        "hidden_size and moe_intermediate_size must be multiples of 32");
  }
  return d;
}

bool Contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// One block; mirrors `block()` of shared/golden/tools/v41_tiny_gen.py tensor by tensor.
absl::Status Block(Builder& ck, const std::string& pre, const Dims& d, int64_t layer_id,
                   bool is_mtp, int64_t engram_rows) {
  const int64_t D = d.D, H = d.H, hd = d.hd, hc = d.hc;
  const int64_t ratio = d.ratios[static_cast<size_t>(layer_id)];
  const int64_t n_exp = is_mtp ? d.n_dspark_exp : d.n_exp;
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(D));
  RETURN_IF_ERROR(ck.Norm(pre + "attn_norm.weight", D));
  RETURN_IF_ERROR(ck.Norm(pre + "ffn_norm.weight", D));
  const std::string a = pre + "attn.";
  RETURN_IF_ERROR(ck.F32(a + "attn_sink", {H}, ck.Normal(static_cast<size_t>(H), 1.0)));
  RETURN_IF_ERROR(ck.Norm(a + "q_norm.weight", d.ql));
  RETURN_IF_ERROR(ck.Norm(a + "kv_norm.weight", hd));
  RETURN_IF_ERROR(ck.Fp8Linear(a + "wq_a", d.ql, D));
  RETURN_IF_ERROR(ck.Fp8Linear(a + "wq_b", H * hd, d.ql, 1.5));
  RETURN_IF_ERROR(ck.Fp8Linear(a + "wkv", hd, D));
  RETURN_IF_ERROR(ck.Fp8Linear(a + "wo_a", d.G * d.ol, H * hd / d.G));
  RETURN_IF_ERROR(ck.Fp8Linear(a + "wo_b", D, d.G * d.ol, 0.3));
  if (!is_mtp && Contains(d.kv_sources, layer_id)) {
    RETURN_IF_ERROR(ck.Norm(a + "compressor.norm.weight", hd));
    RETURN_IF_ERROR(ck.Bf16(a + "compressor.wkv.weight", {hd, D},
                            ck.Normal(static_cast<size_t>(hd * D), inv_sqrt_d)));
    if (ratio > 1) {
      RETURN_IF_ERROR(ck.Bf16(a + "compressor.wgate.weight", {hd, D},
                              ck.Normal(static_cast<size_t>(hd * D), inv_sqrt_d)));
    }
    RETURN_IF_ERROR(ck.Bf16(
        a + "indexer.wk.weight", {d.idx_hd, hd},
        ck.Normal(static_cast<size_t>(d.idx_hd * hd), 1.0 / std::sqrt(static_cast<double>(hd)))));
    RETURN_IF_ERROR(ck.Norm(a + "indexer.k_norm.weight", d.idx_hd));
  }
  if (!is_mtp && Contains(d.index_sources, layer_id)) {
    RETURN_IF_ERROR(ck.Fp8Linear(a + "indexer.wq_b", d.idx_heads * d.idx_hd, d.ql));
    RETURN_IF_ERROR(ck.Bf16(a + "indexer.weights_proj.weight", {d.idx_heads, D},
                            ck.Normal(static_cast<size_t>(d.idx_heads * D), inv_sqrt_d)));
  }
  if (engram_rows > 0) {
    const std::string e = pre + "engram.";
    const int64_t n_cols = (d.eg_ngram - 1) * d.eg_heads;
    RETURN_IF_ERROR(ck.EngramTable(e + "embed", engram_rows, d.eg_hd));
    RETURN_IF_ERROR(ck.Fp8Linear(e + "wkv", D * (hc + 1), n_cols * d.eg_hd, 0.2));
    RETURN_IF_ERROR(
        ck.Bf16(e + "q_weight", {hc, D}, ck.Normal(static_cast<size_t>(hc * D), 0.1, 1.0)));
    RETURN_IF_ERROR(
        ck.Bf16(e + "k_weight", {hc, D}, ck.Normal(static_cast<size_t>(hc * D), 0.1, 1.0)));
  }
  const std::string f = pre + "ffn.";
  RETURN_IF_ERROR(ck.Bf16(f + "gate.weight", {n_exp, D},
                          ck.Normal(static_cast<size_t>(n_exp * D), inv_sqrt_d)));
  RETURN_IF_ERROR(ck.F32(f + "gate.bias", {n_exp}, ck.Normal(static_cast<size_t>(n_exp), 0.05)));
  RETURN_IF_ERROR(ck.F32(f + "gate.bias_vl", {n_exp}, ck.Normal(static_cast<size_t>(n_exp), 0.05)));
  for (int64_t i = 0; i < n_exp; ++i) {
    const std::string x = absl::StrCat(f, "experts.", i, ".");
    RETURN_IF_ERROR(ck.Fp4Linear(x + "w1", d.inter, D, 4.0));
    RETURN_IF_ERROR(ck.Fp4Linear(x + "w2", D, d.inter, 0.008));
    RETURN_IF_ERROR(ck.Fp4Linear(x + "w3", d.inter, D, 4.0));
  }
  RETURN_IF_ERROR(ck.Fp8Linear(f + "shared_experts.w1", d.inter, D, 4.0));
  RETURN_IF_ERROR(ck.Fp8Linear(f + "shared_experts.w2", D, d.inter, 0.008));
  RETURN_IF_ERROR(ck.Fp8Linear(f + "shared_experts.w3", d.inter, D, 4.0));
  const int64_t mix = (2 + hc) * hc;
  for (const char* site : {"attn", "ffn"}) {
    RETURN_IF_ERROR(ck.F32(absl::StrCat(pre, "hc_", site, "_fn"), {mix, hc * D},
                           ck.Normal(static_cast<size_t>(mix * hc * D),
                                     1.0 / std::sqrt(static_cast<double>(hc * D)))));
    std::vector<float> base = ck.Normal(static_cast<size_t>(mix), 0.5);
    for (int64_t i = 0; i < hc; ++i)
      base[static_cast<size_t>(2 * hc + i * hc + i)] += 1.0f;  // comb leans to identity
    RETURN_IF_ERROR(ck.F32(absl::StrCat(pre, "hc_", site, "_base"), {mix}, base));
    std::vector<float> scale = {static_cast<float>(ck.Uniform(0.5, 1.0)),
                                static_cast<float>(ck.Uniform(0.5, 1.0)),
                                static_cast<float>(ck.Uniform(0.5, 1.0))};
    RETURN_IF_ERROR(ck.F32(absl::StrCat(pre, "hc_", site, "_scale"), {3}, scale));
  }
  return absl::OkStatus();
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  out << text;
  if (!out) return absl::InternalError(absl::StrCat("write failed: ", path));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> NanoTokenizerJson() { return NanoTokenizerJsonFor(NanoCorpus()); }

absl::StatusOr<std::string> NanoTokenizerJsonFor(std::string_view corpus) {
  BpeTrainerOptions o;
  o.leading_specials = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"};
  o.trailing_added = {{"<｜User｜>", true},
                      {"<｜Assistant｜>", true},
                      {"<think>", false},
                      {"</think>", false},
                      {"｜DSML｜", false},
                      {"<｜System｜>", false},
                      {"<｜latest_reminder｜>", true},
                      {"<｜deepseek_image｜>", true}};
  o.vocab_size = 2048;
  return TrainByteLevelBpe(corpus, o);
}

absl::Status GenerateCheckpoint(const json& config, uint64_t seed, const std::string& out_dir,
                                int threads) {
  ASSIGN_OR_RETURN(Dims d, ParseDims(config));
  Builder ck(seed, threads);
  RETURN_IF_ERROR(
      ck.Bf16("embed.weight", {d.V, d.D}, ck.Normal(static_cast<size_t>(d.V * d.D), 1.0)));
  RETURN_IF_ERROR(ck.Bf16(
      "head.weight", {d.V, d.D},
      ck.Normal(static_cast<size_t>(d.V * d.D), 3.0 / std::sqrt(static_cast<double>(d.D)))));
  RETURN_IF_ERROR(ck.Norm("norm.weight", d.D));
  for (int64_t lid = 0; lid < d.L; ++lid) {
    int64_t rows = 0;
    for (size_t i = 0; i < d.engram_layers.size(); ++i)
      if (d.engram_layers[i] == lid) rows = d.engram_rows[i];
    RETURN_IF_ERROR(Block(ck, absl::StrCat("layers.", lid, "."), d, lid, false, rows));
  }
  for (int64_t s = 0; s < d.n_mtp; ++s) {
    const std::string pre = absl::StrCat("mtp.", s, ".");
    RETURN_IF_ERROR(Block(ck, pre, d, d.L + s, true, 0));
    if (s == 0) {
      RETURN_IF_ERROR(ck.Fp8Linear(pre + "main_proj", d.D, d.D * d.n_targets));
      RETURN_IF_ERROR(ck.Norm(pre + "main_norm.weight", d.D));
    }
    if (s == d.n_mtp - 1) {
      RETURN_IF_ERROR(ck.Norm(pre + "norm.weight", d.D));
      RETURN_IF_ERROR(ck.Bf16(pre + "markov_head.embed.weight", {d.V, d.markov},
                              ck.Normal(static_cast<size_t>(d.V * d.markov), 1.0)));
      RETURN_IF_ERROR(ck.Bf16(pre + "markov_head.head.weight", {d.V, d.markov},
                              ck.Normal(static_cast<size_t>(d.V * d.markov),
                                        1.0 / std::sqrt(static_cast<double>(d.markov)))));
      RETURN_IF_ERROR(ck.Bf16(pre + "confidence_head.proj.weight", {1, d.D + d.markov},
                              ck.Normal(static_cast<size_t>(d.D + d.markov),
                                        1.0 / std::sqrt(static_cast<double>(d.D + d.markov)))));
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  const std::string shard = "model.safetensors";
  RETURN_IF_ERROR(ck.writer().Write(out_dir + "/" + shard));
  std::map<std::string, std::string> weight_map;
  for (const std::string& n : ck.writer().names()) weight_map[n] = shard;
  return WriteSafetensorsIndex(out_dir + "/model.safetensors.index.json", ck.writer().data_bytes(),
                               weight_map);
}

absl::Status GenerateNanoModel(const std::string& out_dir, uint64_t seed) {
  return GenerateNanoModelFor(out_dir, seed, std::nullopt);
}

absl::Status GenerateNanoModelFor(const std::string& out_dir, uint64_t seed,
                                  std::optional<std::string_view> tokenizer_corpus) {
  ASSIGN_OR_RETURN(std::string tok_json, tokenizer_corpus ? NanoTokenizerJsonFor(*tokenizer_corpus)
                                                          : NanoTokenizerJson());
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::FromJson(tok_json));
  json config = json::parse(NanoConfigJson(), nullptr, false);
  if (config.is_discarded() || !config.contains("text_config")) {
    return absl::InternalError("embedded nano config is not valid JSON with text_config");
  }
  json& tc = config["text_config"];
  // The config's tokenizer-derived fields must agree with the tokenizer.
  if (tc.value("vocab_size", 0) != tok->vocab_size()) {
    return absl::InternalError(absl::StrCat("nano config vocab_size ", tc.value("vocab_size", 0),
                                            " != tokenizer size ", tok->vocab_size()));
  }
  if (tc.value("dspark_noise_token_id", -1) != tok->TokenId("<｜System｜>").value_or(-2)) {
    return absl::InternalError("nano config dspark_noise_token_id is not the <｜System｜> token");
  }
  if (config.value("image_token_id", -1) != tok->TokenId("<｜deepseek_image｜>").value_or(-2)) {
    return absl::InternalError("nano config image_token_id is not the <｜deepseek_image｜> token");
  }
  int64_t classes = 0;
  std::vector<int32_t> token_map = BuildCompressedTokenMap(*tok, &classes);
  // Another tokenizer corpus gives another Engram class count; the embedded nano config
  // describes the default corpus.
  if (tokenizer_corpus) tc["engram_compressed_vocab_size"] = classes;
  ASSIGN_OR_RETURN(EngramConstants engram,
                   ComputeEngramConstants(tc, std::move(token_map), classes));

  RETURN_IF_ERROR(GenerateCheckpoint(config, seed, out_dir));
  RETURN_IF_ERROR(WriteText(out_dir + "/config.json", config.dump(2) + "\n"));
  RETURN_IF_ERROR(WriteText(out_dir + "/tokenizer.json", tok_json));
  json tcfg = {{"add_bos_token", false},
               {"add_eos_token", false},
               {"bos_token", "<｜begin▁of▁sentence｜>"},
               {"eos_token", "<｜end▁of▁sentence｜>"},
               {"pad_token", "<｜▁pad▁｜>"},
               {"clean_up_tokenization_spaces", false},
               {"model_max_length", 1048576},
               {"tokenizer_class", "LlamaTokenizerFast"}};
  RETURN_IF_ERROR(WriteText(out_dir + "/tokenizer_config.json", tcfg.dump(2) + "\n"));
  return engram.Save(out_dir + "/engram_constants.json");
}

json RandomStructureConfig(uint64_t seed) {
  // splitmix64: portable, unlike the <random> distributions.
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  auto next = [&x]() { return Mix64(x += 0x9E3779B97F4A7C15ull); };
  auto pick = [&next](int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); };
  json config = json::parse(NanoConfigJson());
  json& tc = config["text_config"];
  const int n = 4 + pick(5);
  const int n_mtp = 1 + pick(3);
  std::vector<int> ratios(n, 0), kv, index;
  int group_ratio = 0;  // ratio of the latest KV source (0: none yet)
  const int first_source = pick(3) == 0 ? 0 : pick(std::min(3, n - 1));
  for (int l = 0; l < n; ++l) {
    if (l < first_source) continue;  // leading SWA layers
    const int r = pick(8);
    if (l == first_source || r < 2) {  // a new KV source (Full layer)
      group_ratio = 1 + pick(2);
      ratios[l] = group_ratio;
      kv.push_back(l);
      index.push_back(l);
    } else if (r < 3) {
      ratios[l] = 0;  // SWA only
    } else {
      ratios[l] = group_ratio;
      if (r < 5) index.push_back(l);  // Reindex; else Reuse
    }
  }
  for (int s = 0; s < n_mtp; ++s) ratios.push_back(0);
  // The candidate source is the last KV source (ModelConfig::Validate): the decoder layers own no
  // global KV.
  const int split = kv.back();
  std::vector<int> engram;
  if (pick(3) == 0) engram.push_back(0);
  if (pick(3) == 0) engram.push_back(split);
  if (pick(2) == 0) engram.push_back(pick(n));
  std::sort(engram.begin(), engram.end());
  engram.erase(std::unique(engram.begin(), engram.end()), engram.end());
  if (engram.size() > 2) engram.resize(2);
  std::vector<int> targets;
  const int nt = 1 + pick(3);
  for (int i = 0; i < nt; ++i) targets.push_back(pick(n));
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());

  tc["vocab_size"] = 512;
  config["image_token_id"] = 511;
  tc["dspark_noise_token_id"] = 509;
  tc["num_hidden_layers"] = n;
  tc["num_nextn_predict_layers"] = n_mtp;
  tc["sliding_window"] = 16;
  tc["compress_ratios"] = ratios;
  tc["kv_source_layer_ids"] = kv;
  tc["index_source_layer_ids"] = index;
  tc["candidate_source_layer_id"] = split;
  tc["engram_layer_ids"] = engram;
  tc["engram_compressed_vocab_size"] = 512;
  tc.erase("engram_num_embeddings");  // filled from the constants
  tc["dspark_target_layer_ids"] = targets;
  return config;
}

absl::Status GenerateStructureModel(const std::string& out_dir, uint64_t seed) {
  json config = RandomStructureConfig(seed);
  json& tc = config["text_config"];
  const int vocab = tc["vocab_size"].get<int>();
  std::vector<int32_t> token_map(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i) token_map[static_cast<size_t>(i)] = i;
  ASSIGN_OR_RETURN(EngramConstants engram, ComputeEngramConstants(tc, std::move(token_map), vocab));
  tc["engram_num_embeddings"] = engram.num_embeddings;
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  RETURN_IF_ERROR(GenerateCheckpoint(config, seed, out_dir));
  RETURN_IF_ERROR(WriteText(out_dir + "/config.json", config.dump(2) + "\n"));
  return engram.Save(out_dir + "/engram_constants.json");
}

}  // namespace epd::model
