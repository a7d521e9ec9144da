#pragma once

// Byte-level BPE tokenizer that reads a Hugging Face `tokenizer.json` (MODEL.md §5).
//
// Supported subset (anything else is rejected at load with an error naming it):
//   normalizer:    null, NFC, NFD, NFKC, NFKD, Lowercase, Sequence of those
//   pre_tokenizer: Sequence of Split (Regex or String pattern; Isolated, Removed,
//                  MergedWithPrevious, MergedWithNext, Contiguous; invert) and ByteLevel
//                  (add_prefix_space, use_regex)
//   model:         BPE (vocab, merges as "a b" strings or [a, b] pairs, ignore_merges),
//                  no byte_fallback, no dropout
//   decoder:       ByteLevel (or null)
//   added_tokens:  matched literally in the input text (leftmost, longest first), before
//                  normalization/pre-tokenization; lstrip/rstrip honoured; single_word ignored.
// The post_processor is ignored: Encode never adds BOS/EOS (the chat format writes BOS).
//
// Thread-safety: a loaded Tokenizer is immutable; all const methods are safe to call
// concurrently. IncrementalDetokenizer is not thread-safe (one per stream).

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epd::model {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

class Tokenizer {
 public:
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Loads `tokenizer.json`. Errors name the file and the offending field.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);
  // Same, from the JSON text itself.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json_text);

  // Token ids of `text` (UTF-8; invalid UTF-8 bytes are still encoded byte-wise, since
  // every byte has a token). Added tokens appearing literally in the text map to their id.
  // No BOS/EOS is added.
  std::vector<int32_t> Encode(std::string_view text) const;

  // Same, but added tokens are NOT recognised (the text is treated as plain text).
  std::vector<int32_t> EncodeOrdinary(std::string_view text) const;

  // Raw bytes of the concatenated tokens (may be invalid UTF-8 when a multi-byte
  // character is split across the given ids). Added tokens decode to their content
  // (skipped if `skip_special` and the token is special). Unknown ids are an error.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // Decode like HF `tokenizer.decode`: invalid UTF-8 is replaced by U+FFFD (one per maximal
  // invalid subpart, as Rust's String::from_utf8_lossy).
  absl::StatusOr<std::string> DecodeLossy(std::span<const int32_t> ids,
                                          bool skip_special = false) const;

  // Id of a token given its vocabulary string (byte-level form, e.g. "Ġthe") or the
  // content of an added token ("<｜User｜>"). nullopt if absent.
  std::optional<int32_t> TokenId(std::string_view token) const;

  // Vocabulary string of `id` ("" for an id without a token).
  std::string_view TokenString(int32_t id) const;

  // One more than the largest id (vocab and added tokens).
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }

  bool IsAddedToken(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }

  // Splits plain text (no added-token matching) into byte-level words, exactly as the
  // normalizer + pre_tokenizer would before BPE. Used by the BPE trainer.
  std::vector<std::string> PreTokenize(std::string_view text) const;

  // GPT-2 byte <-> unicode mapping used by ByteLevel.
  static const std::array<std::string, 256>& ByteToUnicode();

  struct Impl;  // Normalizer/pre-tokenizer internals (tokenizer.cc).

 private:
  Tokenizer();
  absl::Status Init(std::string_view json_text);
  void EncodePlain(std::string_view text, std::vector<int32_t>& out) const;
  void BpeWord(const std::string& word, std::vector<int32_t>& out) const;
  bool AppendTokenBytes(int32_t id, bool skip_special, std::string& out) const;

  std::unique_ptr<Impl> impl_;
  std::unordered_map<std::string, int32_t> token_to_id_;  // vocab + added contents
  std::vector<std::string> id_to_token_;                  // index = id
  std::vector<int8_t> kind_;                              // 0 none, 1 vocab, 2 added, 3 special
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (a,b) -> (rank, id)
  std::array<int32_t, 256> byte_token_{};  // byte -> single-char token id
  std::vector<AddedToken> added_;
  bool ignore_merges_ = false;
};

// Turns a stream of token ids into text, emitting only complete UTF-8 characters.
// Bytes that can never form a valid character are emitted as U+FFFD.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(tokenizer), skip_special_(skip_special) {}

  // Appends `id`; returns the newly completed text (possibly empty).
  absl::StatusOr<std::string> Add(int32_t id);
  // Returns what is left (an incomplete trailing sequence becomes U+FFFD) and resets.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::string pending_;
};

// Length of the longest prefix of `bytes` that is valid, complete UTF-8 with at most an
// incomplete (but so far valid) trailing sequence cut off.
size_t CompleteUtf8Prefix(std::string_view bytes);
// Rust from_utf8_lossy semantics.
std::string Utf8Lossy(std::string_view bytes);
bool IsValidUtf8(std::string_view bytes);

}  // namespace epd::model
