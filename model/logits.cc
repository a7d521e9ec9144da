// The head and what a forward brings back of its logits (LogitsRequest): the final norm and LM
// head (Head, HeadLogits), the rows' penalties, greedy tokens, seeded draws, DSpark verification
// verdicts and logprobs computed on the backend, and the one download each result needs
// (LogitsToHost); LogitsRequestProblem and VerificationProblem check a request first.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/model.h"
#include "model/scratch.h"

namespace epd::model {
namespace {

using std::vector;

}  // namespace

absl::StatusOr<vector<float>> Model::Head(const Hidden& io, bool all_logits,
                                          ForwardTrace* trace) const {
  const ModelConfig& c = config_;
  const int64_t S = io.rows, D = c.dim, hc = c.hc_mult;
  if (S <= 0 || io.h.size() != static_cast<size_t>(S * hc * D) ||
      io.pre.size() != static_cast<size_t>(S * hc)) {
    return absl::InvalidArgumentError("model: Head needs the residual of its rows");
  }
  // Rows are normed independently: only the rows whose logits (or trace) are wanted go up.
  const int64_t first = all_logits || trace ? 0 : S - 1, n = S - first;
  Scratch ws(backend_, scratch_pool_.get());
  ASSIGN_OR_RETURN(float* h, ws.Copy(io.h.data() + first * hc * D, n * hc * D));
  ASSIGN_OR_RETURN(float* pre, ws.Copy(io.pre.data() + first * hc, n * hc));
  ASSIGN_OR_RETURN(float* logits, HeadLogits(ws, DeviceResidual{h, pre}, n, all_logits, trace));
  return ws.ToHost(logits, (all_logits ? n : 1) * c.vocab_size);
}

absl::StatusOr<float*> Model::HeadLogits(Scratch& ws, const DeviceResidual& r, int64_t S,
                                         bool all_logits, ForwardTrace* trace,
                                         float* logits_out) const {
  const ModelConfig& c = config_;
  const int64_t D = c.dim, hc = c.hc_mult, V = c.vocab_size;
  if (S <= 0 || r.h == nullptr || r.pre == nullptr)
    return absl::InvalidArgumentError("model: Head needs the residual of its rows");
  // Rows are normed independently: only the rows whose logits (or trace) are wanted.
  const int64_t first = all_logits || trace ? 0 : S - 1, n = S - first;
  const float* h = r.h + first * hc * D;
  const float* pre = r.pre + first * hc;
  ASSIGN_OR_RETURN(float* x, ws.Alloc<float>(n * D));
  RETURN_IF_ERROR(backend_.HcPre(n, h, static_cast<int>(hc), D, pre, x));
  RETURN_IF_ERROR(backend_.RmsNorm(x, weights_->norm.data(), n, D, c.norm_eps, x));
  if (trace) RETURN_IF_ERROR(ws.DownloadTo(x, n * D, trace->final_norm));
  const int64_t out_rows = all_logits ? S : 1;
  float* logits = logits_out;
  if (logits == nullptr) {
    ASSIGN_OR_RETURN(logits, ws.Alloc<float>(out_rows * V));
  }
  RETURN_IF_ERROR(
      backend_.LinearF32(x + (n - out_rows) * D, out_rows, weights_->head.plain(), V, D, logits));
  return logits;
}

absl::Status Model::Penalize(Scratch& ws, float* logits, int64_t rows,
                             const LogitPenalties& p) const {
  if (p.at.size() != p.counts.size())
    return absl::InvalidArgumentError("model: penalties need one count per entry");
  if (p.at.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const int64_t* at, ws.Copy(p.at));
  ASSIGN_OR_RETURN(const int32_t* counts, ws.Copy(p.counts));
  return backend_.PenalizeLogits(logits, rows * config_.vocab_size, at, counts,
                                 static_cast<int64_t>(p.at.size()), p.repetition, p.frequency,
                                 p.presence);
}

absl::Status LogitsRequestProblem(const LogitsRequest& out, int64_t rows) {
  if (out.penalties != nullptr && out.penalties->at.size() != out.penalties->counts.size())
    return absl::InvalidArgumentError("model: penalties need one count per entry");
  if (out.out == LogitsOut::kVerify) {
    if (out.verify == nullptr || out.verify->q == nullptr)
      return absl::InvalidArgumentError(
          "model: a verified result needs its drafts and their distributions");
    if (rows < 2 || static_cast<int64_t>(out.verify->drafts.size()) != rows - 1)
      return absl::InvalidArgumentError(absl::StrCat("model: a verified result of ", rows,
                                                     " rows has ", out.verify->drafts.size(),
                                                     " drafts (needs rows - 1 >= 1)"));
  }
  if (out.out != LogitsOut::kSample && out.out != LogitsOut::kVerify) return absl::OkStatus();
  if (out.sample == nullptr)
    return absl::InvalidArgumentError("model: a sampled result needs its sample request");
  if (const char* why = kernels::sampling::ParamsProblem(out.sample->params); why != nullptr)
    return absl::InvalidArgumentError(absl::StrCat("model: sample request: ", why));
  if (static_cast<int64_t>(out.sample->uniforms.size()) != rows) {
    return absl::InvalidArgumentError(absl::StrCat("model: sample request has ",
                                                   out.sample->uniforms.size(),
                                                   " uniforms for ", rows, " rows"));
  }
  for (double u : out.sample->uniforms) {
    if (!(u >= 0.0 && u < 1.0))
      return absl::InvalidArgumentError(absl::StrCat("model: uniform ", u, " is outside [0, 1)"));
  }
  return absl::OkStatus();
}

absl::Status Model::DrawTokens(Scratch& ws, const float* logits, int64_t rows,
                               const SampleRequest& sample, int32_t* tokens) const {
  ASSIGN_OR_RETURN(const double* u, ws.Copy(sample.uniforms));
  return backend_.SampleLogits(logits, rows, config_.vocab_size, sample.params, u, tokens, nullptr);
}

absl::Status Model::VerificationProblem(const LogitsRequest& out) const {
  if (out.out != LogitsOut::kVerify) return absl::OkStatus();
  const int64_t V = config_.vocab_size;
  const DraftVerification& dv = *out.verify;  // LogitsRequestProblem checked it is there
  const auto k = static_cast<int64_t>(dv.drafts.size());
  if (dv.q->bytes() < k * V * static_cast<int64_t>(sizeof(float)))
    return absl::InvalidArgumentError(
        absl::StrCat("model: the distributions of ", k, " drafts do not fit their buffer"));
  for (int32_t d : dv.drafts) {
    if (d < 0 || d >= V)
      return absl::InvalidArgumentError(
          absl::StrCat("model: draft ", d, " is outside the vocabulary"));
  }
  return absl::OkStatus();
}

absl::Status Model::VerifyTokens(Scratch& ws, const float* logits, int64_t rows,
                                 const LogitsRequest& out, int32_t* verdict,
                                 int32_t* chosen) const {
  const int64_t V = config_.vocab_size, k = rows - 1;
  const DraftVerification& dv = *out.verify;
  RETURN_IF_ERROR(VerificationProblem(out));
  // The target rows' distributions (SampleLogits' probs; its draws are not used), then the
  // verdict: two ids are all that comes down.
  ASSIGN_OR_RETURN(float* p, ws.Alloc<float>(rows * V));
  ASSIGN_OR_RETURN(int32_t * draws, ws.Alloc<int32_t>(rows));
  ASSIGN_OR_RETURN(const double* u, ws.Copy(out.sample->uniforms));
  RETURN_IF_ERROR(backend_.SampleLogits(logits, rows, V, out.sample->params, u, draws, p));
  ASSIGN_OR_RETURN(const int32_t* drafts, ws.Copy(dv.drafts));
  return backend_.VerifyDrafts(p, static_cast<const float*>(dv.q->data()), drafts, k, V, u, verdict,
                               chosen);
}

absl::StatusOr<const float*> Model::RawRows(Scratch& ws, const float* logits, int64_t rows,
                                            const LogitsRequest& out) const {
  if (out.top_logprobs < 0 || out.penalties == nullptr || out.penalties->at.empty()) return logits;
  const int64_t n = rows * config_.vocab_size;
  ASSIGN_OR_RETURN(float* raw, ws.Alloc<float>(n));
  RETURN_IF_ERROR(backend_.Copy(raw, logits, n * static_cast<int64_t>(sizeof(float))));
  return static_cast<const float*>(raw);
}

absl::Status Model::LogprobsToHost(Scratch& ws, const float* raw, int64_t rows,
                                   const int32_t* tokens, int top,
                                   std::vector<Logprobs>& out) const {
  const int64_t V = config_.vocab_size, t = top;
  // One buffer of 4-byte words: [rows] tokens, [rows] chosen logprobs, [rows, top] top ids, then
  // [rows, top] their logprobs.
  ASSIGN_OR_RETURN(int32_t * words, ws.Alloc<int32_t>(rows * (2 + 2 * t)));
  RETURN_IF_ERROR(backend_.Copy(words, tokens, rows * static_cast<int64_t>(sizeof(int32_t))));
  float* chosen_lp = reinterpret_cast<float*>(words + rows);
  int32_t* top_ids = words + 2 * rows;
  float* top_lp = reinterpret_cast<float*>(words + 2 * rows + rows * t);
  RETURN_IF_ERROR(backend_.TopLogprobs(raw, rows, V, tokens, t, chosen_lp, top_ids, top_lp));
  std::vector<int32_t> host;
  RETURN_IF_ERROR(ws.DownloadTo(words, rows * (2 + 2 * t), host));
  auto as_float = [&](int64_t i) {
    float f;
    std::memcpy(&f, &host[static_cast<size_t>(i)], sizeof f);
    return f;
  };
  out.assign(static_cast<size_t>(rows), Logprobs{});
  for (int64_t r = 0; r < rows; ++r) {
    Logprobs& lp = out[static_cast<size_t>(r)];
    lp.chosen = {host[static_cast<size_t>(r)], as_float(rows + r)};
    for (int64_t j = 0; j < t; ++j) {
      lp.top.push_back({host[static_cast<size_t>(2 * rows + r * t + j)],
                        as_float(2 * rows + rows * t + r * t + j)});
    }
  }
  return absl::OkStatus();
}

absl::Status Model::LogitsToHost(Scratch& ws, float* logits, int64_t rows,
                                 const LogitsRequest& out, ForwardResult& res) const {
  const int64_t V = config_.vocab_size;
  if (out.out == LogitsOut::kValues) return ws.DownloadTo(logits, rows * V, res.logits);
  RETURN_IF_ERROR(LogitsRequestProblem(out, rows));
  ASSIGN_OR_RETURN(const float* raw, RawRows(ws, logits, rows, out));
  if (out.penalties != nullptr) RETURN_IF_ERROR(Penalize(ws, logits, rows, *out.penalties));
  ASSIGN_OR_RETURN(int32_t * tokens, ws.Alloc<int32_t>(rows));
  if (out.out == LogitsOut::kVerify) {
    // The verdict in tokens' first 2 slots; with logprobs, each row's token in `chosen`.
    int32_t* chosen = nullptr;
    if (out.top_logprobs >= 0) {
      ASSIGN_OR_RETURN(chosen, ws.Alloc<int32_t>(rows));
    }
    RETURN_IF_ERROR(VerifyTokens(ws, logits, rows, out, tokens, chosen));
    if (chosen != nullptr)
      RETURN_IF_ERROR(LogprobsToHost(ws, raw, rows, chosen, out.top_logprobs, res.logprobs));
    return ws.DownloadTo(tokens, 2, res.tokens);
  }
  if (out.out == LogitsOut::kSample) {
    RETURN_IF_ERROR(DrawTokens(ws, logits, rows, *out.sample, tokens));
  } else {
    RETURN_IF_ERROR(backend_.Argmax(logits, rows, V, tokens));
  }
  if (out.top_logprobs >= 0) {
    // The tokens come down with the logprobs.
    RETURN_IF_ERROR(LogprobsToHost(ws, raw, rows, tokens, out.top_logprobs, res.logprobs));
    res.tokens.clear();
    for (const Logprobs& lp : res.logprobs) res.tokens.push_back(lp.chosen.token);
    return absl::OkStatus();
  }
  return ws.DownloadTo(tokens, rows, res.tokens);
}

}  // namespace epd::model
