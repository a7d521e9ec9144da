// Issue 12: a device backend must not be launch-bound on a long prompt. The number of backend
// calls a prefill makes per layer must not grow with the prompt's rows for the ops that the model
// batches over rows (the mHC steps, the linears, the indexer's scores / candidate masks / top-k,
// the MoE's routing, grouping and grouped GEMMs, the compressor's pooling, the attention):
// counted on the CPU backend (TestCpuBackendOptions::op_calls) for prompts of two lengths. A decode
// step runs the weights once for its batch, and its top-k does not cross to the host (the
// Uploads and Downloads counted beside the ops).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/penalty.h"
#include "kernels/sampling_math.h"
#include "model/kv_pool.h"
#include "model/model.h"
#include "model/prefix_state.h"
#include "model/sampling.h"
#include "model/sequence_state.h"
#include "model/stages.h"
#include "tests/testing/golden_model.h"
#include "tests/testing/test_cpu_backend.h"

namespace epd::model {
namespace {

class OpCountTest : public ::testing::TestWithParam<std::string> {};

// The backend calls `measured` makes on a golden model, after `setup` (whose calls, like the
// loading's, are not counted).
std::map<std::string, int64_t> CountOps(const std::string& set,
                                        const std::function<void(Model&)>& setup,
                                        const std::function<void(Model&)>& measured) {
  std::map<std::string, int64_t> calls;
  auto backend = testing::MakeTestCpuBackend({.op_calls = &calls});
  auto m = testing::LoadGoldenModel(*backend, set);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  setup(**m);
  calls.clear();
  measured(**m);
  return calls;
}

std::map<std::string, int64_t> CountPrefill(const std::string& set, int64_t rows) {
  return CountOps(
      set, [](Model&) {},
      [&](Model& m) {
        const int64_t vocab = m.config().vocab_size;
        std::vector<int32_t> ids(rows);
        for (int64_t i = 0; i < rows; ++i) ids[i] = static_cast<int32_t>((i * 7 + 3) % vocab);
        auto seq = m.NewSequence();
        auto r = m.Prefill(*seq, ids, /*all_logits=*/false);
        EXPECT_TRUE(r.ok()) << r.status();
      });
}

TEST_P(OpCountTest, APrefillsCallsDoNotGrowWithItsRows) {
  // 128 rows: more than the compressor log's last 64 rows, so both prompts log their rows the
  // same way (the tails at block boundaries gathered, not one run copied).
  const auto short_prompt = CountPrefill(GetParam(), 128);
  const auto long_prompt = CountPrefill(GetParam(), 512);
  ASSERT_FALSE(short_prompt.empty());
  // Every op is called as often for 512 rows as for 128 (no op of the forward is called per row,
  // per compressed entry, per block or per row and group).
  std::set<std::string> ops;
  for (const auto& [op, n] : short_prompt) ops.insert(op);
  for (const auto& [op, n] : long_prompt) ops.insert(op);
  for (const std::string& op : ops) {
    const auto a = short_prompt.find(op), b = long_prompt.find(op);
    const int64_t na = a == short_prompt.end() ? 0 : a->second;
    const int64_t nb = b == long_prompt.end() ? 0 : b->second;
    EXPECT_EQ(na, nb) << op << ": " << na << " calls at 128 rows, " << nb << " at 512";
  }
  // The batched indexer path is the one a prefill takes.
  EXPECT_GT(long_prompt.count("SelectTopKRows"), 0u);
  EXPECT_EQ(long_prompt.count("SelectTopK"), 0u);
}

// A decode step of several sequences is one forward (Model::ExtendBatch): the weights' ops, the
// head, and the attention's indexer, gathers and SparseAttention run once for the batch; only
// the compressors' appends to each sequence's own KV run per sequence.
std::map<std::string, int64_t> CountDecodeStep(const std::string& set, int batch) {
  std::vector<std::unique_ptr<SequenceState>> seqs;
  std::vector<SequenceState*> ptrs;
  std::vector<std::vector<int32_t>> toks;
  return CountOps(
      set,
      [&](Model& m) {
        for (int b = 0; b < batch; ++b) {
          seqs.push_back(m.NewSequence());
          std::vector<int32_t> prompt(40 + 8 * b);
          for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i % 50);
          EXPECT_TRUE(m.Prefill(*seqs.back(), prompt, false).ok());
          ptrs.push_back(seqs.back().get());
          toks.push_back({static_cast<int32_t>(7 + b)});
        }
      },
      [&](Model& m) {
        auto r = DecodeStep(m, ptrs, toks);
        EXPECT_TRUE(r.ok()) << r.status();
        ptrs.clear();
        seqs.clear();  // the sequences go before their model
      });
}

TEST_P(OpCountTest, ADecodeStepRunsTheWeightsOnceForItsBatch) {
  const auto one = CountDecodeStep(GetParam(), 1);
  const auto four = CountDecodeStep(GetParam(), 4);
  ASSERT_FALSE(one.empty());
  // Also the compressors' projections, their entries' norm, RoPE, qdq and index keys
  // (Model::StepCompress), and the DSpark layers' window rows (the last segment).
  for (const char* op : {"MoeRoute",
                         "MoeGroup",
                         "GroupedLinearQuant",
                         "SwiGlu",
                         "SumSlots",
                         "HcMixesSingleToken",
                         "HcPre",
                         "HcPost",
                         "Embed",
                         "EngramGate",
                         "EngramGateSingleToken",
                         "Fp8RowLookup",
                         "ScaleRoundBf16",
                         "LinearQuant",
                         "LinearF32",
                         "LinearBf16",
                         "RmsNorm",
                         "RopeTables",
                         "Rope",
                         "QuantDequant"}) {
    const auto a = one.find(op), b = four.find(op);
    EXPECT_EQ(a == one.end() ? 0 : a->second, b == four.end() ? 0 : b->second)
        << op << " runs per sequence";
  }
  // The sequences' lists have the same lengths (every top-k is full): one SparseAttention per
  // layer for the batch (Model::StepKv), and every window ring read and written in one call each.
  EXPECT_EQ(four.at("SparseAttention"), one.at("SparseAttention"));
  // The indexer scores, masks and selects every sequence's rows in one call each, straight from
  // the pool's pages (Model::StepIndexer), and the top-k entries of every sequence are gathered
  // and listed in one call each (StepGather), so no indexer or gather call runs per sequence.
  for (const char* op :
       {"IndexerScoresPaged", "CandidateMaskRows", "SelectTopKRows", "TopKSlots", "UnpackRows"})
    EXPECT_EQ(four.at(op), one.at(op)) << op << " runs per sequence";
  for (const char* op : {"IndexerScores", "SelectTopK", "MaskScores", "CandidateMask"})
    EXPECT_EQ(four.count(op), 0u) << op << ": the one-row indexer ran in a batched step";
  // Window rings, compressor logs and tails, the lists' window parts: a fixed number of calls
  // per layer for the batch (PackRows and UnpackRows over the step's pages, one Copy), not per
  // sequence (before, each sequence added Copies for its log, tail, window and lists).
  EXPECT_EQ(four.at("Copy"), one.at("Copy"));
  // Nothing runs per sequence any more: the compressors' entries are appended to every
  // sequence's pool blocks in one PackRows per stream kind (Model::StepAppend). From two
  // sequences on (a step of one row skips the MoE's and the output projection's regrouping), a
  // step makes the same calls for any batch.
  const auto two = CountDecodeStep(GetParam(), 2);
  EXPECT_EQ(four, two);
  auto total = [](const std::map<std::string, int64_t>& calls) {
    int64_t all = 0;
    for (const auto& [op, n] : calls) all += n;
    return static_cast<long long>(all);
  };
  std::printf("[%s] a decode step: %lld backend calls for 1 sequence, %lld for 2, %lld for 4\n",
              GetParam().c_str(), total(one), total(two), total(four));
}

// A decode step's top-k stays on the backend (ModelOptions::device_list_rows): its index layers'
// top-k does not come down to the host and no gather list goes up; TopKSlots completes each
// list on the backend. Against the compact path (device_list_rows = 0) on the same steps: the
// same logits bit for bit, one Download fewer per index layer (SelectTopK), and per attention
// layer no gather list or window list going up (the window part is uploaded once per call).
TEST_P(OpCountTest, ADecodeStepsTopKStaysOnTheBackend) {
  struct Run {
    std::map<std::string, int64_t> calls;
    std::vector<float> logits;
  };
  auto run = [&](int64_t device_list_rows) {
    Run r;
    auto backend = testing::MakeTestCpuBackend({.op_calls = &r.calls});
    auto m = testing::LoadGoldenModel(*backend, GetParam(),
                                      ModelOptions{.device_list_rows = device_list_rows});
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    auto seq = (*m)->NewSequence();
    std::vector<int32_t> prompt(150);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i * 7 % 90);
    EXPECT_TRUE((*m)->Prefill(*seq, prompt, false).ok());
    r.calls.clear();
    for (int32_t t : {5, 9, 11}) {  // three steps: odd and even positions (stale index keys)
      auto step = (*m)->Decode(*seq, t);
      EXPECT_TRUE(step.ok()) << step.status();
      if (step.ok()) r.logits.insert(r.logits.end(), step->logits.begin(), step->logits.end());
    }
    seq.reset();
    return r;
  };
  const Run device = run(16), compact = run(0);
  auto count = [](const Run& r, const char* op) {
    const auto it = r.calls.find(op);
    return it == r.calls.end() ? int64_t{0} : it->second;
  };
  ASSERT_FALSE(device.logits.empty());
  EXPECT_EQ(device.logits, compact.logits);
  EXPECT_GT(count(device, "SelectTopK"), 0);
  EXPECT_EQ(count(device, "SelectTopK"), count(compact, "SelectTopK"));
  EXPECT_GE(count(device, "TopKSlots"), count(device, "SelectTopK"));
  EXPECT_EQ(count(compact, "TopKSlots"), 0);
  EXPECT_EQ(count(device, "Download"), count(compact, "Download") - count(device, "SelectTopK"));
  // And the lists' window part goes up once per call and list shape (the golden sets have two:
  // layers with and without a compressed part), not once per attention layer; neither path
  // uploads a gather list.
  const int64_t steps = 3, shapes = 2;
  EXPECT_EQ(count(compact, "Upload") - count(device, "Upload"),
            count(device, "TopKSlots") + count(device, "SparseAttention") - steps * shapes);
  std::printf("[%s] 3 decode steps: Uploads %lld (compact path %lld), Downloads %lld (%lld)\n",
              GetParam().c_str(), static_cast<long long>(count(device, "Upload")),
              static_cast<long long>(count(compact, "Upload")),
              static_cast<long long>(count(device, "Download")),
              static_cast<long long>(count(compact, "Download")));
}

// On a device backend a prefill's top-k stays there too while the KV sources fit unpacked whole
// (ModelOptions::whole_source_bytes): each attention layer unpacks its source once and TopKSlots
// writes each slot's entry into the lists; no top-k comes down and no gather list goes up.
// Against the compact path (whole_source_bytes = 0) on the same device-labelled backend: the
// same logits bit for bit and one Download fewer per index layer. On a host backend the compact
// path stays (no TopKSlots).
TEST_P(OpCountTest, APrefillsTopKStaysOnADeviceBackend) {
  struct Run {
    std::map<std::string, int64_t> calls;
    std::vector<float> logits;
    int64_t index_layers = 0;
  };
  auto run = [&](bool device, int64_t whole_source_bytes) {
    Run r;
    auto backend =
        testing::MakeTestCpuBackend({.report_device_memory = device, .op_calls = &r.calls});
    auto m = testing::LoadGoldenModel(
        *backend, GetParam(), ModelOptions{.whole_source_bytes = whole_source_bytes}, device);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    r.index_layers = static_cast<int64_t>((*m)->config().index_source_layers.size());
    auto seq = (*m)->NewSequence();
    std::vector<int32_t> prompt(256);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i * 11 % 97);
    r.calls.clear();
    auto out = (*m)->Prefill(*seq, prompt, /*all_logits=*/true);
    EXPECT_TRUE(out.ok()) << out.status();
    if (out.ok()) r.logits = out->logits;
    seq.reset();
    return r;
  };
  const Run whole = run(true, int64_t{64} << 20), compact = run(true, 0);
  const Run host = run(false, int64_t{64} << 20);
  auto count = [](const Run& r, const char* op) {
    const auto it = r.calls.find(op);
    return it == r.calls.end() ? int64_t{0} : it->second;
  };
  ASSERT_FALSE(whole.logits.empty());
  ASSERT_GT(whole.index_layers, 0);
  EXPECT_EQ(whole.logits, compact.logits);
  EXPECT_EQ(whole.logits, host.logits);
  EXPECT_GT(count(whole, "TopKSlots"), 0);
  EXPECT_EQ(count(compact, "TopKSlots"), 0);
  EXPECT_EQ(count(host, "TopKSlots"), 0);
  EXPECT_EQ(count(whole, "Download"), count(compact, "Download") - whole.index_layers);
  std::printf("[%s] 256-row prefill on a device: Downloads %lld (compact path %lld)\n",
              GetParam().c_str(), static_cast<long long>(count(whole, "Download")),
              static_cast<long long>(count(compact, "Download")));
}

// A greedy sequence's tokens can come from the backend (LogitsOut::kArgmax): its logits rows stay
// in backend memory and only their argmax comes down. On a device-labelled backend, a batched
// step of three single-token sequences (argmax, values, argmax) and a step of one sequence alone
// (argmax) against the same steps with every sequence's values: the argmax equals the host's
// ArgMax of each values row (the host Sampler's greedy token for the one with penalties, applied
// on the backend), the values rows are equal, and the downloaded bytes differ by exactly the
// logits rows not brought down less the tokens that were.
TEST_P(OpCountTest, AGreedySequencesTokensComeFromTheBackend) {
  struct Run {
    int64_t bytes = 0;                    // downloaded during the steps
    std::vector<ForwardResult> batch;     // the batched step's results
    ForwardResult alone;                  // the step of one sequence
  };
  // Sequence 2's step and the step alone apply a sampler's penalties on the backend.
  SamplingParams params;
  params.repetition_penalty = 1.3f;
  params.frequency_penalty = 0.8f;
  params.presence_penalty = 0.25f;
  std::unique_ptr<Sampler> sampler;
  LogitPenalties penalties{params.repetition_penalty, params.frequency_penalty,
                           params.presence_penalty};
  auto run = [&](bool argmax) {
    Run r;
    auto backend =
        testing::MakeTestCpuBackend({.report_device_memory = true, .download_bytes = &r.bytes});
    auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    std::vector<std::unique_ptr<SequenceState>> seqs;
    std::vector<SequenceState*> ptrs;
    std::vector<std::vector<int32_t>> toks;
    for (int b = 0; b < 3; ++b) {
      seqs.push_back((*m)->NewSequence());
      std::vector<int32_t> prompt(60 + 13 * b);
      for (size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<int32_t>(3 + (i * 7 + b) % 90);
      EXPECT_TRUE((*m)->Prefill(*seqs.back(), prompt, false).ok());
      ptrs.push_back(seqs.back().get());
      toks.push_back({static_cast<int32_t>(5 + b)});
      if (b == 0 && sampler == nullptr) {  // its prompt and a few generated tokens (one twice)
        sampler = std::make_unique<Sampler>(params, (*m)->config().vocab_size, prompt);
        for (int32_t t : {7, 40, 7, 99}) sampler->Accept(t);
      }
    }
    const LogitsOut A = LogitsOut::kArgmax, V = LogitsOut::kValues;
    const LogitsRequest P(A, &penalties);
    const std::vector<LogitsRequest> outs =
        argmax ? std::vector<LogitsRequest>{A, V, P} : std::vector<LogitsRequest>{V, V, V};
    r.bytes = 0;
    auto step = DecodeStep(**m, ptrs, toks, nullptr, outs);
    EXPECT_TRUE(step.ok()) << step.status();
    if (step.ok()) r.batch = std::move(*step);
    const std::vector<LogitsRequest> one = {argmax ? P : V};
    auto alone = DecodeStep(**m, std::span<SequenceState* const>(ptrs).first(1),
                            std::span<const std::vector<int32_t>>(toks).subspan(1, 1), nullptr,
                            one);
    EXPECT_TRUE(alone.ok()) << alone.status();
    if (alone.ok()) r.alone = std::move((*alone)[0]);
    ptrs.clear();
    seqs.clear();
    return r;
  };
  const Run values = run(false);
  ASSERT_EQ(values.batch.size(), 3u);
  const int64_t vocab = static_cast<int64_t>(values.alone.logits.size());
  ASSERT_GT(vocab, 0);
  auto argmax_of = [&](const std::vector<float>& l) {
    std::vector<int32_t> best;
    for (size_t r = 0; r + vocab <= l.size(); r += vocab)
      best.push_back(ArgMax(std::span<const float>(l.data() + r, vocab)));
    return best;
  };
  // The unpenalized greedy tokens of the two penalized rows, generated 5 times each: their
  // penalized greedy tokens must be others.
  const int32_t plain2 = argmax_of(values.batch[2].logits)[0];
  const int32_t plain_alone = argmax_of(values.alone.logits)[0];
  for (int i = 0; i < 5; ++i) {
    sampler->Accept(plain2);
    sampler->Accept(plain_alone);
  }
  sampler->PenaltyEntries({}, 1, penalties.at, penalties.counts);
  const Run tokens = run(true);
  ASSERT_EQ(tokens.batch.size(), 3u);
  for (int b : {0, 2}) {
    EXPECT_TRUE(tokens.batch[b].logits.empty()) << b;
    ASSERT_EQ(tokens.batch[b].tokens.size(), 1u) << b;
  }
  EXPECT_EQ(tokens.batch[0].tokens, argmax_of(values.batch[0].logits));
  // Penalized on the backend: the host Sampler's greedy token of the same row.
  ASSERT_FALSE(penalties.at.empty());
  EXPECT_EQ(tokens.batch[2].tokens[0], sampler->Greedy(values.batch[2].logits));
  EXPECT_NE(tokens.batch[2].tokens[0], plain2);
  EXPECT_EQ(tokens.batch[1].logits, values.batch[1].logits);
  EXPECT_TRUE(tokens.batch[1].tokens.empty());
  EXPECT_TRUE(tokens.alone.logits.empty());
  ASSERT_EQ(tokens.alone.tokens.size(), 1u);
  EXPECT_EQ(tokens.alone.tokens[0], sampler->Greedy(values.alone.logits));
  EXPECT_NE(tokens.alone.tokens[0], plain_alone);
  // Batched: 3 rows of values (one download) against every row's token and one row of values;
  // alone: one row of values against its token.
  const int64_t row = vocab * static_cast<int64_t>(sizeof(float)), id = sizeof(int32_t);
  EXPECT_EQ(values.bytes - tokens.bytes, (3 * row - (3 * id + row)) + (row - id));
  std::printf("[%s] a batched step of 3 and a step alone download %lld bytes (%lld with every "
              "sequence's logits)\n",
              GetParam().c_str(), static_cast<long long>(tokens.bytes),
              static_cast<long long>(values.bytes));
}

// A T > 0 sequence's tokens can come from the backend too (LogitsOut::kSample): its rows are
// drawn there (Backend::SampleLogits) with the uniforms the caller's Rng gave. On a
// device-labelled backend, a batched step of a sampled sequence, a values sequence and a
// sampled sequence with penalties and every filter verifying three rows (the last token and two
// drafts): each draw equals the host Sampler's draw from the values rows of the same step
// (Probabilities, row j penalized as after drafts[0, j), then SampleFromProbs with the same
// uniform), and the bytes differ by exactly the rows not brought down less their tokens. A
// request without its uniforms, or with one outside [0, 1), fails the call before it changes
// any state.
TEST_P(OpCountTest, ASampledSequencesTokensComeFromTheBackend) {
  struct Run {
    int64_t bytes = 0;
    std::vector<ForwardResult> batch;
  };
  SamplingParams hot;
  hot.temperature = 0.9f;
  SamplingParams filtered;
  filtered.temperature = 1.3f;
  filtered.top_k = 40;
  filtered.top_p = 0.85f;
  filtered.min_p = 0.01f;
  filtered.repetition_penalty = 1.2f;
  filtered.frequency_penalty = 0.4f;
  filtered.seed = 5;
  std::unique_ptr<Sampler> hot_sampler, filtered_sampler;
  const std::vector<int32_t> drafts = {11, 12};
  LogitPenalties penalties{filtered.repetition_penalty, filtered.frequency_penalty,
                           filtered.presence_penalty};
  SampleRequest hot_draw, filtered_draw;
  // The verified run: the drafts' distributions (host rows, uploaded to each run's backend), a
  // first row that favours draft 11 over what the target gives it, so the test is a real one.
  std::vector<float> q_host;
  auto run = [&](bool sample, SampleRequest* bad, bool verify = false) {
    Run r;
    auto backend =
        testing::MakeTestCpuBackend({.report_device_memory = true, .download_bytes = &r.bytes});
    auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    const int64_t vocab = (*m)->config().vocab_size;
    std::vector<std::unique_ptr<SequenceState>> seqs;
    std::vector<SequenceState*> ptrs;
    std::vector<std::vector<int32_t>> toks;
    for (int b = 0; b < 3; ++b) {
      seqs.push_back((*m)->NewSequence());
      std::vector<int32_t> prompt(50 + 17 * b);
      for (size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<int32_t>(4 + (i * 5 + b) % 80);
      EXPECT_TRUE((*m)->Prefill(*seqs.back(), prompt, false).ok());
      ptrs.push_back(seqs.back().get());
      toks.push_back({static_cast<int32_t>(6 + b)});
      if (hot_sampler == nullptr && b == 0) hot_sampler = std::make_unique<Sampler>(hot, vocab);
      if (filtered_sampler == nullptr && b == 2) {
        filtered_sampler = std::make_unique<Sampler>(filtered, vocab, prompt);
        for (int32_t t : {11, 30, 11}) filtered_sampler->Accept(t);
        filtered_sampler->PenaltyEntries(drafts, 3, penalties.at, penalties.counts);
        hot_draw = {hot_sampler->DrawParams(), {hot_sampler->rng().NextUniform()}};
        filtered_draw = {filtered_sampler->DrawParams(), {}};
        for (int j = 0; j < 3; ++j)
          filtered_draw.uniforms.push_back(filtered_sampler->rng().NextUniform());
      }
    }
    toks[2].insert(toks[2].end(), drafts.begin(), drafts.end());
    const LogitsOut S = LogitsOut::kSample, V = LogitsOut::kValues;
    std::vector<LogitsRequest> outs =
        sample ? std::vector<LogitsRequest>{{S, nullptr, &hot_draw},
                                            V,
                                            {S, &penalties, &filtered_draw}}
               : std::vector<LogitsRequest>{V, V, V};
    DraftVerification verification;
    if (verify) {
      q_host.assign(static_cast<size_t>(2 * vocab), 0.f);
      for (int64_t v = 0; v < vocab; ++v) {
        q_host[v] = v == drafts[0] ? 0.5f : 0.5f / static_cast<float>(vocab - 1);
        q_host[vocab + v] = 1.f / static_cast<float>(vocab);
      }
      auto q = backend->Allocate(static_cast<int64_t>(q_host.size() * sizeof(float)));
      EXPECT_TRUE(q.ok()) << q.status();
      if (!q.ok()) return r;
      EXPECT_TRUE(backend->Upload(q_host.data(), q->bytes(), *q, 0).ok());
      verification.q = std::make_shared<kernels::Buffer>(std::move(*q));
      verification.drafts = drafts;
      outs[2] = LogitsRequest(LogitsOut::kVerify, &penalties, &filtered_draw, &verification);
      outs[2].top_logprobs = 3;
    }
    if (bad != nullptr) {
      outs[0] = LogitsRequest(S, nullptr, bad);
      const int64_t pos = ptrs[0]->pos;
      auto step = DecodeStep(**m, ptrs, toks, nullptr, outs);
      EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
      EXPECT_EQ(ptrs[0]->pos, pos) << "a refused step changed the state";
      return r;
    }
    r.bytes = 0;
    auto step = DecodeStep(**m, ptrs, toks, nullptr, outs);
    EXPECT_TRUE(step.ok()) << step.status();
    if (step.ok()) r.batch = std::move(*step);
    ptrs.clear();
    seqs.clear();
    return r;
  };
  const Run values = run(false, nullptr);
  const Run drawn = run(true, nullptr);
  ASSERT_EQ(values.batch.size(), 3u);
  ASSERT_EQ(drawn.batch.size(), 3u);
  const int64_t vocab = static_cast<int64_t>(values.batch[0].logits.size());
  ASSERT_GT(vocab, 0);
  ASSERT_EQ(static_cast<int64_t>(values.batch[2].logits.size()), 3 * vocab);
  ASSERT_FALSE(penalties.at.empty());
  auto host_draw = [&](const Sampler& s, const std::vector<float>& l, int j, double u) {
    std::vector<float> probs;
    s.Probabilities(std::span<const float>(l.data() + j * vocab, vocab),
                    std::span<const int32_t>(drafts).first(j), probs);
    return SampleFromProbs(probs, u);
  };
  ASSERT_EQ(drawn.batch[0].tokens.size(), 1u);
  EXPECT_TRUE(drawn.batch[0].logits.empty());
  EXPECT_EQ(drawn.batch[0].tokens[0],
            host_draw(*hot_sampler, values.batch[0].logits, 0, hot_draw.uniforms[0]));
  EXPECT_EQ(drawn.batch[1].logits, values.batch[1].logits);
  ASSERT_EQ(drawn.batch[2].tokens.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(drawn.batch[2].tokens[j], host_draw(*filtered_sampler, values.batch[2].logits, j,
                                                  filtered_draw.uniforms[j]))
        << "row " << j;
  }
  const int64_t row = vocab * static_cast<int64_t>(sizeof(float)), id = sizeof(int32_t);
  // Values: 5 rows in one download; drawn: every row's token (5) and the values row.
  EXPECT_EQ(values.bytes - drawn.bytes, 5 * row - (5 * id + row));
  // Refused: no uniforms, a uniform of 1, a temperature of 0.
  SampleRequest none{hot_sampler->DrawParams(), {}};
  SampleRequest one{hot_sampler->DrawParams(), {1.0}};
  SampleRequest cold{{.temperature = 0.f}, {0.5}};
  for (SampleRequest* bad : {&none, &one, &cold}) run(true, bad);

  // The filtered sequence's two drafts verified on the backend (LogitsOut::kVerify,
  // Backend::VerifyDrafts): the verdict, 2 ids, is the host's rejection sampling
  // (kernels::sampling::VerifyDrafts) on the Sampler's distributions of the values rows (row j
  // penalized as after drafts[0, j)) with the same uniforms, and with each row's logprobs (of its
  // draft, or of the verdict's token at its row and the last) it is all that comes down of its 3
  // rows.
  const Run verified = run(true, nullptr, /*verify=*/true);
  ASSERT_EQ(verified.batch.size(), 3u);
  ASSERT_EQ(verified.batch[2].tokens.size(), 2u);
  EXPECT_TRUE(verified.batch[2].logits.empty());
  EXPECT_EQ(verified.batch[0].tokens, drawn.batch[0].tokens);
  std::vector<float> p(static_cast<size_t>(3 * vocab)), probs, residual;
  for (int j = 0; j < 3; ++j) {
    filtered_sampler->Probabilities(
        std::span<const float>(values.batch[2].logits.data() + j * vocab, vocab),
        std::span<const int32_t>(drafts).first(j), probs);
    std::copy(probs.begin(), probs.end(), p.begin() + j * vocab);
  }
  const kernels::sampling::DraftVerdict want = kernels::sampling::VerifyDrafts(
      p.data(), q_host.data(), drafts.data(), 2, vocab, filtered_draw.uniforms.data(), residual);
  EXPECT_EQ(verified.batch[2].tokens[0], want.accepted);
  EXPECT_EQ(verified.batch[2].tokens[1], want.token);
  ASSERT_EQ(verified.batch[2].logprobs.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    const int32_t token = j != want.accepted && j < 2 ? drafts[static_cast<size_t>(j)] : want.token;
    const Logprobs lp = ComputeLogprobs(
        std::span<const float>(values.batch[2].logits.data() + j * vocab, vocab), token, 3);
    const Logprobs& got = verified.batch[2].logprobs[static_cast<size_t>(j)];
    EXPECT_EQ(got.chosen.token, token) << "row " << j;
    EXPECT_EQ(got.chosen.logprob, lp.chosen.logprob) << "row " << j;
    ASSERT_EQ(got.top.size(), 3u);
    for (size_t e = 0; e < 3; ++e) {
      EXPECT_EQ(got.top[e].token, lp.top[e].token) << "row " << j;
      EXPECT_EQ(got.top[e].logprob, lp.top[e].logprob) << "row " << j;
    }
  }
  // Every row's token slot (5 ids), the values row, then 3 rows of (2 + 2 * 3) logprob words.
  EXPECT_EQ(verified.bytes, drawn.bytes + 3 * (2 + 2 * 3) * 4);
}

// A verification the model cannot make is refused before any state changes, naming the cause:
// distributions of one draft for two, a draft outside the vocabulary, no distributions, drafts
// that are not the rows after the first, a uniform short.
TEST_P(OpCountTest, AVerificationItCannotMakeIsRefusedBeforeTheStep) {
  auto backend = testing::MakeTestCpuBackend({.report_device_memory = true});
  auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t V = (*m)->config().vocab_size;
  auto st = (*m)->NewSequence();
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i % 50);
  ASSERT_TRUE((*m)->Prefill(*st, prompt, false).ok());
  auto one_row = backend->Allocate(V * static_cast<int64_t>(sizeof(float)));
  auto two_rows = backend->Allocate(2 * V * static_cast<int64_t>(sizeof(float)));
  ASSERT_TRUE(one_row.ok() && two_rows.ok());
  const auto small = std::make_shared<kernels::Buffer>(std::move(*one_row));
  const auto q = std::make_shared<kernels::Buffer>(std::move(*two_rows));
  SampleRequest sample{{.temperature = 0.7f}, {0.1, 0.2, 0.3}};
  SampleRequest short_of{{.temperature = 0.7f}, {0.1, 0.2}};
  struct Case {
    const char* why;
    DraftVerification v;
    const SampleRequest* sample;
    int top_logprobs;
  };
  const Case cases[] = {
      {"do not fit their buffer", {small, {4, 5}}, &sample, -1},
      {"outside the vocabulary", {q, {4, static_cast<int32_t>(V)}}, &sample, -1},
      {"needs its drafts and their distributions", {nullptr, {4, 5}}, &sample, -1},
      {"has 1 drafts", {q, {4}}, &sample, -1},
      {"uniform", {q, {4, 5}}, &short_of, -1},
  };
  for (const Case& c : cases) {
    LogitsRequest out(LogitsOut::kVerify, nullptr, c.sample, &c.v);
    out.top_logprobs = c.top_logprobs;
    SequenceState* states[] = {st.get()};
    const std::vector<std::vector<int32_t>> tokens = {{9, 4, 5}};
    const int64_t pos = st->pos;
    auto r = DecodeStep(**m, states, tokens, nullptr, std::span(&out, 1));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.why;
    EXPECT_NE(r.status().message().find(c.why), std::string::npos) << r.status();
    EXPECT_EQ(st->pos, pos) << c.why << ": a refused step changed the state";
  }
}

// A sequence that asks for logprobs gets them from the backend with its tokens
// (LogitsRequest::top_logprobs; Backend::TopLogprobs on the raw rows, before the penalties): on a
// device-labelled backend, a batched step of a greedy sequence with penalties verifying three
// rows (the last token and two drafts) and a values sequence. Each row's logprobs equal
// model::ComputeLogprobs of the values run's raw row and the row's token, bit for bit; the token
// is the host Sampler's penalized greedy pick; and the bytes differ by exactly the three rows not
// brought down less their tokens and their logprob words.
TEST_P(OpCountTest, ALogprobsSequencesLogprobsComeFromTheBackend) {
  struct Run {
    int64_t bytes = 0;
    std::vector<ForwardResult> batch;
  };
  constexpr int kTop = 4;
  SamplingParams greedy;
  greedy.repetition_penalty = 1.3f;
  greedy.presence_penalty = 0.5f;
  greedy.top_logprobs = kTop;
  std::unique_ptr<Sampler> sampler;
  const std::vector<int32_t> drafts = {21, 22};
  LogitPenalties penalties{greedy.repetition_penalty, greedy.frequency_penalty,
                           greedy.presence_penalty};
  auto run = [&](bool on_backend) {
    Run r;
    auto backend =
        testing::MakeTestCpuBackend({.report_device_memory = true, .download_bytes = &r.bytes});
    auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    std::vector<std::unique_ptr<SequenceState>> seqs;
    std::vector<SequenceState*> ptrs;
    std::vector<std::vector<int32_t>> toks;
    for (int b = 0; b < 2; ++b) {
      seqs.push_back((*m)->NewSequence());
      std::vector<int32_t> prompt(44 + 13 * b);
      for (size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<int32_t>(5 + (i * 7 + b) % 70);
      EXPECT_TRUE((*m)->Prefill(*seqs.back(), prompt, false).ok());
      ptrs.push_back(seqs.back().get());
      toks.push_back({static_cast<int32_t>(9 + b)});
      if (sampler == nullptr && b == 0) {
        sampler = std::make_unique<Sampler>(greedy, (*m)->config().vocab_size, prompt);
        for (int32_t t : {21, 40}) sampler->Accept(t);
        sampler->PenaltyEntries(drafts, 3, penalties.at, penalties.counts);
      }
    }
    toks[0].insert(toks[0].end(), drafts.begin(), drafts.end());
    std::vector<LogitsRequest> outs = {LogitsOut::kValues, LogitsOut::kValues};
    if (on_backend) {
      outs[0] = LogitsRequest(LogitsOut::kArgmax, &penalties);
      outs[0].top_logprobs = kTop;
    }
    r.bytes = 0;
    auto step = DecodeStep(**m, ptrs, toks, nullptr, outs);
    EXPECT_TRUE(step.ok()) << step.status();
    if (step.ok()) r.batch = std::move(*step);
    return r;
  };
  const Run values = run(false);
  const Run lp = run(true);
  ASSERT_EQ(values.batch.size(), 2u);
  ASSERT_EQ(lp.batch.size(), 2u);
  ASSERT_FALSE(penalties.at.empty());
  const int64_t vocab = static_cast<int64_t>(values.batch[1].logits.size());
  ASSERT_EQ(static_cast<int64_t>(values.batch[0].logits.size()), 3 * vocab);
  EXPECT_TRUE(lp.batch[0].logits.empty());
  EXPECT_EQ(lp.batch[1].logits, values.batch[1].logits);
  ASSERT_EQ(lp.batch[0].tokens.size(), 3u);
  ASSERT_EQ(lp.batch[0].logprobs.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    const std::span<const float> raw(values.batch[0].logits.data() + j * vocab, vocab);
    const int32_t token = lp.batch[0].tokens[j];
    EXPECT_EQ(token, sampler->Greedy(raw, std::span<const int32_t>(drafts).first(j))) << j;
    const Logprobs want = ComputeLogprobs(raw, token, kTop);
    const Logprobs& got = lp.batch[0].logprobs[j];
    EXPECT_EQ(got.chosen.token, token) << j;
    EXPECT_EQ(got.chosen.logprob, want.chosen.logprob) << j;
    ASSERT_EQ(got.top.size(), static_cast<size_t>(kTop)) << j;
    for (int t = 0; t < kTop; ++t) {
      EXPECT_EQ(got.top[t].token, want.top[t].token) << j << " " << t;
      EXPECT_EQ(got.top[t].logprob, want.top[t].logprob) << j << " " << t;
    }
  }
  const int64_t row = vocab * static_cast<int64_t>(sizeof(float)), word = 4;
  // Values: 4 rows in one download; logprobs: every row's token (4, one download), the values
  // row, and the 3 rows' words (token, chosen logprob, kTop ids and logprobs: one download).
  EXPECT_EQ(values.bytes - lp.bytes, 4 * row - (4 * word + row + 3 * (2 + 2 * kTop) * word));
}

// On a device pool the global-KV blocks a forward fills are sealed together at its end
// (KvRows::AppendFrom leaves them pending, Model::Commit seals them with SealPending): the
// decode step that crosses a 64-token boundary fills a block of several streams and downloads
// once more than a step that fills none, not once per block, and what comes down is each block's
// 8-byte digest (Backend::DigestBlocks), not its bytes. The blocks are sealed after it, and a
// second sequence with the same tokens shares every one of them: the hash and the byte
// comparison still run, the comparison on the backend (one BlocksEqual for every hit, 4 bytes
// each down). Its logits are the first's.
TEST_P(OpCountTest, ABlockBoundaryStepSealsItsBlocksWithOneDownload) {
  std::map<std::string, int64_t> calls;
  int64_t down_bytes = 0;
  auto backend = testing::MakeTestCpuBackend(
      {.report_device_memory = true, .op_calls = &calls, .download_bytes = &down_bytes});
  auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  KvPool& pool = (*m)->kv_pool();
  ASSERT_FALSE(pool.host_memory());
  std::vector<int32_t> prompt(60);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i * 7 % 90);
  auto sealed = [&](const SequenceState& st) {
    int64_t n = 0;
    for (const auto& [l, src] : st.sources) {
      for (const KvRows* rows : {&src.kv, &src.keys}) {
        for (const KvPool::Block& b : rows->blocks()) n += pool.sealed(b.id);
      }
    }
    return n;
  };
  auto downloads = [&] {
    const auto it = calls.find("Download");
    return it == calls.end() ? int64_t{0} : it->second;
  };
  auto count = [&](const char* op) {
    const auto it = calls.find(op);
    return it == calls.end() ? int64_t{0} : it->second;
  };
  std::unique_ptr<SequenceState> seqs[2];
  std::vector<std::vector<float>> logits[2];
  int64_t step_downloads[2][4] = {}, step_bytes[2][4] = {}, digests[2] = {}, compares[2] = {};
  int64_t newly_sealed = 0;
  for (int i = 0; i < 2; ++i) {
    seqs[i] = (*m)->NewSequence();
    ASSERT_TRUE((*m)->Prefill(*seqs[i], prompt, false).ok());
    for (int s = 0; s < 4; ++s) {  // positions 60..63: the last fills each stream's first block
      const int64_t before = sealed(*seqs[i]), d0 = downloads(), b0 = down_bytes;
      const int64_t dg0 = count("DigestBlocks"), eq0 = count("BlocksEqual");
      auto step = (*m)->Decode(*seqs[i], static_cast<int32_t>(5 + s));
      ASSERT_TRUE(step.ok()) << step.status();
      step_downloads[i][s] = downloads() - d0;
      step_bytes[i][s] = down_bytes - b0;
      if (s == 3) {
        digests[i] = count("DigestBlocks") - dg0;
        compares[i] = count("BlocksEqual") - eq0;
      }
      logits[i].push_back(step->logits);
      if (i == 0 && s == 3) newly_sealed = sealed(*seqs[i]) - before;
      if (s < 3) {
        EXPECT_EQ(sealed(*seqs[i]), before) << "step " << s;
      }
    }
    for (const auto& [l, src] : seqs[i]->sources) EXPECT_FALSE(src.kv.has_pending_seals()) << l;
  }
  EXPECT_GT(newly_sealed, 1) << "the boundary step should fill several streams' blocks";
  // The first sequence reads its blocks once; the second its blocks and, once, the registered
  // blocks they equal (the byte comparison of every hit).
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(step_downloads[i][3], step_downloads[i][2] + 1 + i) << "sequence " << i;
    EXPECT_EQ(step_downloads[i][1], step_downloads[i][2]) << "sequence " << i;
    EXPECT_EQ(digests[i], 1) << "sequence " << i;
    EXPECT_EQ(compares[i], i) << "sequence " << i;
    // Each sealed block's digest (and, for the second, its comparison's answer) and nothing more
    // of it: the step's other downloads are a plain step's (its logits).
    EXPECT_EQ(step_bytes[i][3] - step_bytes[i][2], newly_sealed * (8 + 4 * i)) << "sequence " << i;
  }
  EXPECT_EQ(logits[1], logits[0]);
  // The second sequence holds the first's blocks: every sealed block of it is shared.
  int64_t shared = 0, total = 0;
  for (const auto& [l, src] : seqs[1]->sources) {
    const auto& mine = src.kv.blocks();
    const auto& theirs = seqs[0]->sources.at(l).kv.blocks();
    ASSERT_EQ(mine.size(), theirs.size()) << l;
    for (size_t b = 0; b < mine.size(); ++b) {
      if (!pool.sealed(mine[b].id)) continue;
      ++total;
      shared += mine[b].id == theirs[b].id;
    }
  }
  EXPECT_GT(total, 0);
  EXPECT_EQ(shared, total);
  std::printf(
      "[%s] a block-boundary decode step seals %lld blocks: %lld Downloads of %lld bytes, "
      "%lld of %lld bytes in a step that seals none\n",
      GetParam().c_str(), static_cast<long long>(newly_sealed),
      static_cast<long long>(step_downloads[0][3]), static_cast<long long>(step_bytes[0][3]),
      static_cast<long long>(step_downloads[0][2]), static_cast<long long>(step_bytes[0][2]));
}

// A batched decode step's DSpark inputs stay on a device backend (Model::KeepMainHidden): a step
// of a sequence verifying three drafts and a plain one downloads only its tokens, the rollback
// picks the kept row there, and a hand-off reads it once (MainHiddenOf, SerializeState). What it
// reads equals, bit for bit, the DSpark input a host-memory run of the same steps keeps.
TEST_P(OpCountTest, ABatchedStepsDSparkInputsStayOnTheBackend) {
  std::map<std::string, int64_t> calls;
  auto dev = testing::MakeTestCpuBackend({.report_device_memory = true, .op_calls = &calls});
  auto plain = kernels::MakeCpuBackend();
  auto m = testing::LoadGoldenModel(*dev, GetParam(), ModelOptions{}, /*device=*/true);
  auto h = testing::LoadGoldenModel(*plain, GetParam());
  ASSERT_TRUE(m.ok() && h.ok());
  const ModelConfig& c = (*m)->config();
  if (c.dspark_target_layer_ids.empty()) GTEST_SKIP() << "no DSpark inputs in this set";
  auto count = [&](const char* op) {
    const auto it = calls.find(op);
    return it == calls.end() ? int64_t{0} : it->second;
  };
  const std::vector<std::vector<int32_t>> steps = {{17, 4, 29, 8}, {23}};
  std::vector<std::vector<float>> kept(2);
  for (Model* model : {m->get(), h->get()}) {
    std::vector<std::unique_ptr<SequenceState>> seqs;
    std::vector<SequenceState*> ptrs;
    for (int b = 0; b < 2; ++b) {
      std::vector<int32_t> prompt(150 - 20 * b);
      for (size_t i = 0; i < prompt.size(); ++i)
        prompt[i] = static_cast<int32_t>(3 + (i * 5 + b) % 80);
      seqs.push_back(model->NewSequence());
      ASSERT_TRUE(model->Prefill(*seqs.back(), prompt, false).ok());
      ptrs.push_back(seqs.back().get());
    }
    const StepCheckpoint ck = model->Checkpoint(*ptrs[0], 4);
    ASSERT_TRUE(ck.status.ok()) << ck.status;
    const std::vector<LogitsRequest> outs = {LogitsOut::kArgmax, LogitsOut::kArgmax};
    calls.clear();
    auto r = DecodeStep(*model, ptrs, steps, nullptr, outs);
    ASSERT_TRUE(r.ok()) << r.status();
    const bool on_device = model == m->get();
    if (on_device) {
      EXPECT_EQ(count("Download"), 1) << "the tokens only";
      EXPECT_TRUE(ptrs[0]->main_hidden.empty());
      EXPECT_EQ(ptrs[0]->main_hidden_row, 3);
      EXPECT_EQ(ptrs[1]->main_hidden_row, 0);
    }
    calls.clear();
    ASSERT_TRUE(model->Rollback(*ptrs[0], ck, std::vector<int32_t>{17, 4}, (*r)[0]).ok());
    EXPECT_EQ(count("Download"), 0);
    EXPECT_EQ(ptrs[0]->main_hidden_pos, ptrs[0]->pos - 1);
    for (int b = 0; b < 2; ++b) {
      calls.clear();
      auto mh = MainHiddenOf(*ptrs[b]);
      ASSERT_TRUE(mh.ok()) << mh.status();
      EXPECT_EQ(count("Download"), on_device ? 1 : 0);
      EXPECT_EQ(static_cast<int64_t>(mh->size()),
                static_cast<int64_t>(c.dspark_target_layer_ids.size()) * c.dim);
      if (on_device) {
        kept[b] = std::move(*mh);
      } else {
        EXPECT_EQ(*mh, kept[b]) << "sequence " << b;
        EXPECT_EQ(*mh, ptrs[b]->main_hidden);
      }
    }
    if (!on_device) continue;
    // A hand-off serializes what the backend kept.
    std::vector<StateSegment> segs = SerializeState(c, *ptrs[0]);
    bool found = false;
    for (const StateSegment& s : segs) {
      if (s.name != "main_hidden") continue;
      found = true;
      EXPECT_EQ(s.bytes.size(), kept[0].size() * 2);
    }
    EXPECT_TRUE(found);
  }
}

// A DSpark verification step's checkpoint and rollback of the SWA rings stay on the backend: the
// checkpoint copies the step's slots of every ring into backend memory with backend Copies (two
// at most per ring), and the rollback copies the rejected ones back; neither downloads nor
// uploads. The state after the rollback equals a sequence that decoded only the kept tokens:
// every ring, and the logits of the next step.
TEST_P(OpCountTest, AVerificationStepsCheckpointAndRollbackStayOnTheBackend) {
  std::map<std::string, int64_t> calls;
  auto backend = testing::MakeTestCpuBackend({.report_device_memory = true, .op_calls = &calls});
  auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int32_t> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i * 5 % 80);
  auto st = (*m)->NewSequence(), ref = (*m)->NewSequence();
  ASSERT_TRUE((*m)->Prefill(*st, prompt, false).ok());
  ASSERT_TRUE((*m)->Prefill(*ref, prompt, false).ok());
  const std::vector<int32_t> step = {17, 4, 29, 8};  // the last token and three drafts
  auto count = [&](const char* op) {
    const auto it = calls.find(op);
    return it == calls.end() ? int64_t{0} : it->second;
  };
  calls.clear();
  const StepCheckpoint ck = (*m)->Checkpoint(*st, static_cast<int64_t>(step.size()));
  ASSERT_TRUE(ck.status.ok()) << ck.status;
  EXPECT_EQ(count("Download"), 0);
  EXPECT_EQ(count("Upload"), 0);
  EXPECT_GE(count("Copy"), static_cast<int64_t>(st->swa.size()));
  auto r = (*m)->Extend(*st, step, /*all_logits=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  calls.clear();
  const std::vector<int32_t> keep = {17, 4};
  ASSERT_TRUE((*m)->Rollback(*st, ck, keep, *r).ok());
  EXPECT_EQ(count("Download"), 0);
  EXPECT_EQ(count("Upload"), 0);
  EXPECT_GT(count("Copy"), 0);
  ASSERT_TRUE((*m)->Extend(*ref, keep, /*all_logits=*/true).ok());
  ASSERT_EQ(st->swa.size(), ref->swa.size());
  for (size_t l = 0; l < st->swa.size(); ++l) EXPECT_TRUE(st->swa[l] == ref->swa[l]) << l;
  auto a = (*m)->Decode(*st, 23), b = (*m)->Decode(*ref, 23);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->logits, b->logits);
  st.reset();
  ref.reset();
}

// A DSpark draft pass chains its Markov head on the backend (each position's argmax picks the
// next position's Markov embedding row there): it downloads its ids and confidences once each at
// its end (and its logits when asked), not one id per position. Each draft id is the argmax of
// its position's returned logits (the Markov bias of the chain included), and asking for the ids
// only gives the same ids and confidences.
TEST_P(OpCountTest, ADraftPassDownloadsOnlyAtItsEnd) {
  std::map<std::string, int64_t> calls;
  auto backend = testing::MakeTestCpuBackend({.report_device_memory = true, .op_calls = &calls});
  auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, /*device=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  if ((*m)->config().n_mtp_layers == 0) GTEST_SKIP() << "no DSpark stages in this set";
  std::vector<int32_t> prompt(90);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + i * 13 % 70);
  auto st = (*m)->NewSequence();
  ASSERT_TRUE((*m)->Prefill(*st, prompt, false).ok());
  auto count = [&](const char* op) {
    const auto it = calls.find(op);
    return it == calls.end() ? int64_t{0} : it->second;
  };
  calls.clear();
  auto values = (*m)->Draft(*st, 9);
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(count("Download"), 3);  // ids, logits, confidences
  calls.clear();
  auto ids = (*m)->Draft(*st, 9, {}, LogitsOut::kArgmax);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(count("Download"), 2);
  EXPECT_TRUE(ids->logits.empty());
  EXPECT_EQ(ids->ids, values->ids);
  EXPECT_EQ(ids->confidence, values->confidence);
  const int64_t V = (*m)->config().vocab_size, B = (*m)->config().dspark_block_size;
  ASSERT_EQ(static_cast<int64_t>(values->ids.size()), B + 1);
  EXPECT_EQ(values->ids[0], 9);
  for (int64_t i = 0; i < B; ++i) {
    EXPECT_EQ(values->ids[i + 1],
              ArgMax(std::span<const float>(values->logits.data() + i * V, V)))
        << "position " << i;
  }
  // Forced ids replace the chain (and are checked against the vocabulary).
  const std::vector<int32_t> forced(B - 1, 5);
  auto f = (*m)->Draft(*st, 9, forced);
  ASSERT_TRUE(f.ok()) << f.status();
  for (int64_t i = 0; i + 1 < B; ++i) EXPECT_EQ(f->ids[i + 1], 5);
  EXPECT_FALSE((*m)->Draft(*st, 9, std::vector<int32_t>{static_cast<int32_t>(V)}).ok());

  // A penalized greedy chain is chained on the backend too: the penalties (a large presence
  // penalty on the plain chain's first draft) apply to every position before its argmax, so the
  // first draft is the argmax of position 0's logits with that penalty (position 0's bias is
  // the input token's in both passes), and still only the ids and confidences come down.
  const int32_t first = values->ids[1];
  LogitPenalties pen;
  pen.presence = 1000.f;
  pen.at = {first};
  pen.counts = {1};
  calls.clear();
  auto penalized = (*m)->Draft(*st, 9, {}, LogitsOut::kArgmax, &pen);
  ASSERT_TRUE(penalized.ok()) << penalized.status();
  EXPECT_EQ(count("Download"), 2);
  EXPECT_EQ(count("PenalizeLogits"), B);
  EXPECT_TRUE(penalized->logits.empty());
  std::vector<float> row0(values->logits.begin(), values->logits.begin() + V);
  row0[first] -= 1000.f;
  EXPECT_NE(penalized->ids[1], first);
  EXPECT_EQ(penalized->ids[1], ArgMax(row0));
  for (int64_t i = 0; i < B; ++i) EXPECT_NE(penalized->ids[i + 1], first) << "position " << i;
  // A T > 0 chain is drawn on the backend: position i's draft is the draw with uniform i from
  // the distribution of its logits (the Markov bias of the chain drawn so far, then the
  // penalties), which stays there (DraftResult::q); only the ids and confidences come down. The
  // host's arithmetic on the logits of that same chain (forced ids, kValues) gives every
  // distribution and every draw bit for bit.
  SampleRequest sample;
  sample.params.temperature = 1.3f;
  sample.params.top_k = 40;
  sample.params.top_p = 0.95f;
  for (int64_t i = 0; i < B; ++i) sample.uniforms.push_back(std::fmod(0.13 + 0.61 * i, 1.0));
  calls.clear();
  auto drawn = (*m)->Draft(*st, 9, {}, LogitsOut::kSample, &pen, &sample);
  ASSERT_TRUE(drawn.ok()) << drawn.status();
  EXPECT_EQ(count("Download"), 2);
  EXPECT_EQ(count("SampleLogits"), B);
  EXPECT_TRUE(drawn->logits.empty());
  ASSERT_NE(drawn->q, nullptr);
  ASSERT_GE(drawn->q->bytes(), B * V * static_cast<int64_t>(sizeof(float)));
  std::vector<float> q(static_cast<size_t>(B * V));
  ASSERT_TRUE(backend->Download(*drawn->q, 0, B * V * sizeof(float), q.data()).ok());
  auto chain = (*m)->Draft(*st, 9, std::span<const int32_t>(drawn->ids).subspan(1, B - 1));
  ASSERT_TRUE(chain.ok()) << chain.status();
  EXPECT_EQ(chain->confidence, drawn->confidence);
  std::vector<float> probs(static_cast<size_t>(V));
  std::vector<int32_t> order;
  for (int64_t i = 0; i < B; ++i) {
    std::vector<float> row(chain->logits.begin() + i * V, chain->logits.begin() + (i + 1) * V);
    row[first] = kernels::Penalized(row[first], 1, 1.f, 0.f, pen.presence);
    kernels::sampling::FilteredProbs(row.data(), V, sample.params, probs.data(), order);
    EXPECT_TRUE(std::equal(probs.begin(), probs.end(), q.begin() + i * V)) << "position " << i;
    EXPECT_EQ(drawn->ids[i + 1], kernels::sampling::DrawIndex(probs.data(), V, sample.uniforms[i]))
        << "position " << i;
    EXPECT_NE(drawn->ids[i + 1], first) << "position " << i;
  }
  // A draw needs a uniform per position in [0, 1).
  SampleRequest short_of = sample;
  short_of.uniforms.pop_back();
  EXPECT_EQ((*m)->Draft(*st, 9, {}, LogitsOut::kSample, nullptr, &short_of).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Penalties only with kArgmax or kSample, and entries of one row.
  EXPECT_EQ((*m)->Draft(*st, 9, {}, LogitsOut::kValues, &pen).status().code(),
            absl::StatusCode::kInvalidArgument);
  LogitPenalties outside = pen;
  outside.at = {V};
  EXPECT_EQ((*m)->Draft(*st, 9, {}, LogitsOut::kArgmax, &outside).status().code(),
            absl::StatusCode::kInvalidArgument);
  st.reset();
}

// A store write's cut (CutPrefixBlocks) on a device backend reads each KV source's rows and its
// compressor log once, whatever the number of blocks: a 4-block cut makes the same Downloads as
// a 2-block cut (before: two reads per source per block, and two per logged row of a tail). The
// values equal a host backend's bit for bit.
TEST_P(OpCountTest, APrefixCutsReadsDoNotGrowWithItsBlocks) {
  struct Run {
    std::map<std::string, int64_t> calls;
    std::vector<std::string> blocks;
  };
  auto run = [&](bool device, int64_t tokens) {
    Run r;
    auto backend =
        testing::MakeTestCpuBackend({.report_device_memory = device, .op_calls = &r.calls});
    auto m = testing::LoadGoldenModel(*backend, GetParam(), ModelOptions{}, device);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return r;
    const int64_t vocab = (*m)->config().vocab_size;
    std::vector<int32_t> prompt(tokens);
    for (int64_t i = 0; i < tokens; ++i) prompt[i] = static_cast<int32_t>((i * 13 + 5) % vocab);
    auto seq = (*m)->NewSequence();
    EXPECT_TRUE((*m)->Prefill(*seq, prompt, /*all_logits=*/false).ok());
    r.calls.clear();
    auto blocks = CutPrefixBlocks(**m, *seq, prompt, 0, tokens / kPrefixBlockTokens);
    EXPECT_TRUE(blocks.ok()) << blocks.status();
    if (blocks.ok()) r.blocks = *blocks;
    seq.reset();
    return r;
  };
  const Run two = run(true, 2 * kPrefixBlockTokens), four = run(true, 4 * kPrefixBlockTokens);
  const Run host = run(false, 4 * kPrefixBlockTokens);
  ASSERT_EQ(four.blocks.size(), 4u);
  EXPECT_EQ(four.blocks, host.blocks);
  ASSERT_GT(four.calls.count("Download"), 0u);
  EXPECT_EQ(four.calls.at("Download"), two.calls.at("Download"));
  std::printf("[%s] prefix cut of 4 blocks on a device: %lld Downloads (2 blocks: %lld)\n",
              GetParam().c_str(), static_cast<long long>(four.calls.at("Download")),
              static_cast<long long>(two.calls.at("Download")));
}

INSTANTIATE_TEST_SUITE_P(Sets, OpCountTest, ::testing::ValuesIn(testing::GoldenSets()),
                         testing::GoldenSetName);

}  // namespace
}  // namespace epd::model
