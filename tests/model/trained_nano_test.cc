// The committed trained demo model (models/epd-nano; tools/train/, docs/demo.md): it loads, has
// the documented hash, its logits equal the PyTorch training module's bit for bit (stored
// reference logits, tests/data/trained_nano_parity/, so no torch is needed), and its greedy answer to the
// README's prompt is made of dictionary words, a check the random nano model fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tokenizer/chat_format.h"
#include "model/model.h"
#include "model/nano/nano_generator.h"
#include "tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace epd::model {
namespace {

using testing::SourcePath;

// sha256 of models/epd-nano/model.safetensors; the same value is in docs/demo.md.
constexpr char kTrainedNanoSha256[] =
    "b624302e4584407eb7d7f6c01d2b470efae216112f02ca136c78c8cf69e5855c";
// The README's curl prompt (README.md, docs/demo.md).
constexpr char kReadmePrompt[] = "Tell me about files.";

std::string ModelDir() { return SourcePath("models/epd-nano"); }

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Words = maximal runs of ASCII letters of length >= 2; returns (in dictionary, total).
std::pair<int, int> DictionaryWords(const std::string& text, const std::set<std::string>& dict) {
  int in = 0, total = 0;
  std::string w;
  auto flush = [&] {
    if (w.size() >= 2) {
      ++total;
      in += dict.contains(w) ? 1 : 0;
    }
    w.clear();
  };
  for (char ch : text) {
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      w += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    } else {
      flush();
    }
  }
  flush();
  return {in, total};
}

std::set<std::string> Dictionary() {
  std::set<std::string> dict;
  std::istringstream in(ReadText(SourcePath("tests/data/trained_nano_parity/words.txt")));
  for (std::string w; std::getline(in, w);) {
    if (!w.empty()) dict.insert(w);
  }
  return dict;
}

// Greedy chat answer of the model in `dir` to `prompt` (chat mode, as the server renders it).
std::string GreedyAnswer(const std::string& dir, const std::string& prompt, int max_tokens) {
  auto backend = kernels::MakeCpuBackend();
  auto m = Model::Load(dir, *backend);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return "";
  auto tok = Tokenizer::FromFile(dir + "/tokenizer.json");
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (!tok.ok()) return "";
  auto text = RenderChat({{"user", prompt}}, {}, ChatRenderOptions{});
  EXPECT_TRUE(text.ok());
  std::vector<int32_t> ids = (*tok)->Encode(*text);
  auto st = (*m)->NewSequence();
  auto r = (*m)->Prefill(*st, ids, false);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<int32_t> out;
  const int64_t V = (*m)->config().vocab_size;
  for (int i = 0; i < max_tokens && r.ok(); ++i) {
    const int32_t next = static_cast<int32_t>(
        std::max_element(r->logits.end() - V, r->logits.end()) - (r->logits.end() - V));
    if (next == (*m)->config().eos_token_id) break;
    out.push_back(next);
    r = (*m)->Decode(*st, next);
  }
  auto text_out = (*tok)->DecodeLossy(out);
  EXPECT_TRUE(text_out.ok());
  return text_out.ok() ? *text_out : std::string();
}

TEST(TrainedNanoTest, CheckpointHasTheDocumentedHash) {
  std::string out;
  ASSERT_EQ(testing::RunCommand("sha256sum " + ModelDir() + "/model.safetensors", &out), 0) << out;
  EXPECT_EQ(out.substr(0, 64), kTrainedNanoSha256);
  EXPECT_NE(ReadText(SourcePath("docs/demo.md")).find(kTrainedNanoSha256), std::string::npos)
      << "docs/demo.md must state the checkpoint hash";
}

TEST(TrainedNanoTest, LogitsMatchTheTorchReference) {
  auto backend = kernels::MakeCpuBackend();
  auto m = Model::Load(ModelDir(), *backend);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string pdir = SourcePath("tests/data/trained_nano_parity");
  auto prompts = nlohmann::json::parse(ReadText(pdir + "/prompts.json"))["prompts"];
  const std::string raw = ReadText(pdir + "/logits.bin");
  const int64_t V = (*m)->config().vocab_size;
  ASSERT_EQ(raw.size(), prompts.size() * V * sizeof(float));
  std::vector<float> ref(raw.size() / sizeof(float));
  std::memcpy(ref.data(), raw.data(), raw.size());
  ASSERT_GE(prompts.size(), 3u);
  // tools/train/parity.py picks prompts whose routing decisions at the last position clear a
  // margin: a top-k near-tie there may route either way in a correct evaluation, and one flip
  // moves these logits far outside the envelope (docs/demo.md "Parity").
  const auto margins = nlohmann::json::parse(ReadText(pdir + "/prompts.json"))["route_margins"];
  ASSERT_EQ(margins.size(), prompts.size());
  for (size_t k = 0; k < prompts.size(); ++k) {
    EXPECT_GE(margins[k]["last"].get<double>(), 0.01) << "prompt " << k;
    std::vector<int32_t> ids = prompts[k].get<std::vector<int32_t>>();
    auto st = (*m)->NewSequence();
    auto r = (*m)->Prefill(*st, ids, false);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(static_cast<int64_t>(r->logits.size()), V);
    const float* g = ref.data() + k * V;
    double num = 0, den = 0;
    for (int64_t v = 0; v < V; ++v) {
      num += (double(r->logits[v]) - g[v]) * (double(r->logits[v]) - g[v]);
      den += double(g[v]) * g[v];
    }
    // Golden envelope (tests/data/golden/*/manifest.json): a valid different accumulation order
    // of the reference gives rel_rms 0.054 on the 8-layer tiny model; this model has 12 layers.
    std::printf("prompt %zu (%zu tokens): logits rel_rms %.3g\n", k, ids.size(),
                std::sqrt(num / den));
    // The PyTorch module's "ref" numerics follow the reference's summation orders as the engine
    // does (issue 55; tools/train/v41.py): the same bits.
    EXPECT_EQ(std::memcmp(r->logits.data(), g, V * sizeof(float)), 0)
        << "prompt " << k << " (" << ids.size() << " tokens): rel_rms " << std::sqrt(num / den);
    std::vector<float> sorted(g, g + V);
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    const auto top = [](const float* v, int64_t n) { return std::max_element(v, v + n) - v; };
    if (sorted[0] - sorted[1] > 0.5f) {  // a clear top-1: both implementations pick it
      EXPECT_EQ(top(r->logits.data(), V), top(g, V)) << "prompt " << k;
    }
  }
}

TEST(TrainedNanoTest, AnswersTheReadmePromptInDictionaryWords) {
  const std::set<std::string> dict = Dictionary();
  ASSERT_GE(dict.size(), 1000u);
  const std::string answer = GreedyAnswer(ModelDir(), kReadmePrompt, 32);
  const auto [in, total] = DictionaryWords(answer, dict);
  EXPECT_GE(total, 8) << answer;
  EXPECT_GE(in, total * 0.8) << answer;

  // The same check on the random-weight nano model fails: it tells a trained model apart.
  testing::TempDir dir;
  ASSERT_TRUE(GenerateNanoModel(dir.path()).ok());
  const std::string noise = GreedyAnswer(dir.path(), kReadmePrompt, 32);
  const auto [rin, rtotal] = DictionaryWords(noise, dict);
  EXPECT_TRUE(rtotal < 8 || rin < rtotal * 0.8) << noise;
}

}  // namespace
}  // namespace epd::model
