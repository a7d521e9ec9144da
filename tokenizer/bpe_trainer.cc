#include "tokenizer/bpe_trainer.h"

#include <map>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace epd::model {

const char* const kDeepSeekPreTokenizerJson = R"json({
  "type": "Sequence",
  "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[一-龥\u3040-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]
})json";

namespace {

using ojson = nlohmann::ordered_json;

uint64_t Key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

ojson BuildJson(const BpeTrainerOptions& o, const std::vector<std::string>& tokens,
                const std::vector<std::pair<std::string, std::string>>& merges) {
  ojson j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  ojson added = ojson::array();
  int32_t id = 0;
  for (const std::string& s : o.leading_specials) {
    added.push_back({{"id", id++},
                     {"content", s},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  id = static_cast<int32_t>(tokens.size());
  for (const auto& a : o.trailing_added) {
    added.push_back({{"id", id++},
                     {"content", a.content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", !a.special},
                     {"special", a.special}});
  }
  j["added_tokens"] = added;
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = ojson::parse(kDeepSeekPreTokenizerJson);
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"},
                  {"add_prefix_space", true},
                  {"trim_offsets", true},
                  {"use_regex", true}};
  ojson vocab = ojson::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = static_cast<int32_t>(i);
  ojson m = ojson::array();
  for (const auto& [a, b] : merges) m.push_back(a + " " + b);
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", m}};
  return j;
}

}  // namespace

absl::StatusOr<std::string> TrainByteLevelBpe(std::string_view corpus, const BpeTrainerOptions& o) {
  std::vector<std::string> tokens = o.leading_specials;
  std::unordered_map<std::string, int32_t> index;
  for (size_t i = 0; i < tokens.size(); ++i) index[tokens[i]] = static_cast<int32_t>(i);
  const auto& b2u = Tokenizer::ByteToUnicode();
  for (const std::string& b : b2u) {
    index[b] = static_cast<int32_t>(tokens.size());
    tokens.push_back(b);
  }
  const int32_t target_base = o.vocab_size - static_cast<int32_t>(o.trailing_added.size());
  if (target_base < static_cast<int32_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_size ", o.vocab_size, " is smaller than ",
                                                   tokens.size() + o.trailing_added.size(),
                                                   " fixed tokens"));
  }
  // Pre-tokenize with a merge-free tokenizer that has the same pipeline.
  std::vector<std::pair<std::string, std::string>> merges;
  ASSIGN_OR_RETURN(auto base, Tokenizer::FromJson(BuildJson(o, tokens, merges).dump()));
  std::map<std::string, int64_t> word_counts;
  for (std::string& w : base->PreTokenize(corpus)) ++word_counts[w];

  struct Word {
    std::vector<int32_t> sym;
    int64_t count;
  };
  std::vector<Word> words;
  for (const auto& [w, c] : word_counts) {
    Word word{{}, c};
    // Split into byte-level characters (each is one token).
    for (size_t i = 0; i < w.size();) {
      size_t len = 1;
      const auto b = static_cast<uint8_t>(w[i]);
      if (b >= 0xF0)
        len = 4;
      else if (b >= 0xE0)
        len = 3;
      else if (b >= 0xC0)
        len = 2;
      word.sym.push_back(index.at(w.substr(i, len)));
      i += len;
    }
    words.push_back(std::move(word));
  }
  std::unordered_map<uint64_t, int64_t> pairs;
  auto add_pairs = [&](const Word& w, int64_t sign) {
    for (size_t i = 0; i + 1 < w.sym.size(); ++i)
      pairs[Key(w.sym[i], w.sym[i + 1])] += sign * w.count;
  };
  for (const Word& w : words) add_pairs(w, +1);

  while (static_cast<int32_t>(tokens.size()) < target_base) {
    uint64_t best = 0;
    int64_t best_count = 0;
    for (const auto& [k, c] : pairs) {
      if (c <= 0) continue;
      if (c > best_count) {
        best = k;
        best_count = c;
        continue;
      }
      if (c == best_count) {
        const auto& ka = tokens[k >> 32];
        const auto& kb = tokens[k & 0xFFFFFFFFu];
        const auto& ba = tokens[best >> 32];
        const auto& bb = tokens[best & 0xFFFFFFFFu];
        if (ka < ba || (ka == ba && kb < bb)) best = k;
      }
    }
    if (best_count == 0) {
      return absl::FailedPreconditionError(absl::StrCat("BPE corpus exhausted after ",
                                                        merges.size(), " merges; vocab reached ",
                                                        tokens.size(), " of ", target_base));
    }
    const auto a = static_cast<int32_t>(best >> 32), b = static_cast<int32_t>(best & 0xFFFFFFFFu);
    const std::string merged = tokens[static_cast<size_t>(a)] + tokens[static_cast<size_t>(b)];
    merges.emplace_back(tokens[static_cast<size_t>(a)], tokens[static_cast<size_t>(b)]);
    int32_t new_id;
    if (auto it = index.find(merged); it != index.end()) {
      new_id = it->second;
    } else {
      new_id = static_cast<int32_t>(tokens.size());
      tokens.push_back(merged);
      index[merged] = new_id;
    }
    for (Word& w : words) {
      bool has = false;
      for (size_t i = 0; i + 1 < w.sym.size() && !has; ++i)
        has = w.sym[i] == a && w.sym[i + 1] == b;
      if (!has) continue;
      add_pairs(w, -1);
      std::vector<int32_t> s;
      for (size_t i = 0; i < w.sym.size(); ++i) {
        if (i + 1 < w.sym.size() && w.sym[i] == a && w.sym[i + 1] == b) {
          s.push_back(new_id);
          ++i;
        } else {
          s.push_back(w.sym[i]);
        }
      }
      w.sym = std::move(s);
      add_pairs(w, +1);
    }
    pairs.erase(best);
  }
  return BuildJson(o, tokens, merges).dump(1);
}

}  // namespace epd::model
