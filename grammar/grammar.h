#pragma once

// Constrained decoding (docs/api.md, "Structured output"): a grammar compiled from a JSON schema
// (response_format json_schema / json_object) or from tool definitions (tool_choice "required" /
// a named function, in the model's DSML tool-call format), a byte-level matcher over it, and the
// per-step token mask over the tokenizer's vocabulary.
//
// The grammar is a small graph of nodes (literals, JSON strings, numbers, objects, arrays, anyOf,
// sequences, free text up to a terminator, and byte automata (automaton.h) for constrained
// strings, bounded numbers and enums; $ref recursion makes it cyclic). The matcher keeps a set
// of alternative stacks of frames (anyOf and the choice of the next key fork them; bytes that do
// not fit kill a stack), so a prefix is valid iff some stack survives. The output is compact JSON
// (no whitespace).
//
// Termination: the mask also keeps the output completable within the tokens left: a token is
// allowed only if the shortest completion after it (in bytes; every single byte is a token of a
// byte-level BPE vocabulary) fits in the remaining budget. So an output that reaches max_tokens
// is still complete and valid. EOS is allowed only where the output is complete.
//
// Thread-safety: a Grammar is immutable and shared (cached per constraint); a Matcher is owned by
// one sequence; TokenMasker is immutable after construction and may be used from any thread.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grammar/automaton.h"

namespace epd::grammar {

enum class NodeKind {
  kLiteral,
  kString,
  kNumber,
  kInteger,
  kObject,
  kArray,
  kAnyOf,
  kSequence,
  kUntil,
  kText,  // a JSON string whose decoded bytes a Dfa accepts (pattern / format / length)
  kBytes  // bytes a Dfa accepts, ending where the Dfa cannot go on (bounded numbers, enum)
};

struct Node {
  NodeKind kind = NodeKind::kLiteral;
  std::string text;  // kLiteral: the bytes; kUntil: the terminator
  // kObject: optional literal nodes (-1 = none) around and between the properties.
  int open = -1, close = -1, sep = -1;
  struct Prop {
    int head = -1;   // literal node: everything before the value (`"name":`)
    int value = -1;  // the value's node
    int tail = -1;   // literal node after the value (-1 = none)
    bool required = false;
  };
  std::vector<Prop> props;  // in emission order (schema order)
  bool free_keys = false;   // any string key (kString node `key`), then `colon`, then `value`
  int key = -1, colon = -1, value = -1;
  // kArray: open/sep/close as above, the item node and the count bounds (max -1 = unbounded).
  int item = -1;
  int min_items = 0, max_items = -1;
  std::vector<int> children;  // kAnyOf alternatives / kSequence parts
  int64_t min_len = 0;        // bytes of the shortest complete match
  // kText / kBytes: the automaton (Grammar::dfa). kText with a plain-text automaton may also
  // count characters (min_chars / max_chars, -1 = unbounded) instead of a product automaton.
  int dfa = -1;
  int64_t min_chars = 0, max_chars = -1;
};

class Grammar {
 public:
  const Node& node(int i) const { return nodes_[static_cast<size_t>(i)]; }
  int root() const { return root_; }
  size_t size() const { return nodes_.size(); }
  const Dfa& dfa(int i) const { return dfas_[static_cast<size_t>(i)]; }

 private:
  friend class Builder;
  std::vector<Node> nodes_;
  std::vector<Dfa> dfas_;
  int root_ = -1;
};

// The constraint as the router sends it to the decode worker (SamplingParams.constraint):
//   {"type":"json_object"}                        any JSON object
//   {"type":"json_schema","schema":{...}}         a value valid against the schema
//   {"type":"tool_calls","tools":[{"name":...,"parameters":{...}}],"parallel":bool}
//                                                 a DSML tool-call block calling those tools
//   optional "thinking": true                     free text up to </think> first
//   optional "strict": false                      best effort: keywords outside the subset
//                                                 are ignored instead of refused
// Schema subset (docs/api.md lists it): types and type lists, properties / required /
// additionalProperties (false or true), items / minItems / maxItems, enum / const, anyOf /
// oneOf (as anyOf) / allOf of one schema, $ref into the document ($defs, definitions, recursion
// included), nullable, string minLength / maxLength / pattern (automaton.h's regex subset) /
// format (date-time, date, time, duration, email, hostname, uuid, ipv4, ipv6, uri), number and
// integer minimum / maximum / exclusiveMinimum / exclusiveMaximum / multipleOf; annotations
// (title, description, default, examples, $schema, $id, $comment, readOnly, ...) are ignored.
// Any other keyword is InvalidArgument naming it and where it is ("unsupported JSON schema
// keyword 'not' at $.properties.id"). Every number the grammar admits parses to a finite double.
// Limits (InvalidArgument beyond them): enum 1000 values (20000 bytes), 20000 states per
// automaton, 200000 automaton states and 100000 nodes per grammar.
absl::StatusOr<std::shared_ptr<const Grammar>> Compile(std::string_view constraint_json);

// Compiled grammars by constraint text (bounded; the oldest entry goes first). Thread-safe.
class GrammarCache {
 public:
  explicit GrammarCache(size_t capacity = 64) : capacity_(capacity) {}
  absl::StatusOr<std::shared_ptr<const Grammar>> Get(const std::string& constraint_json);
  int64_t hits() const;
  int64_t misses() const;

 private:
  mutable absl::Mutex mu_;
  size_t capacity_;
  std::vector<std::pair<std::string, std::shared_ptr<const Grammar>>> entries_;  // oldest first
  int64_t hits_ = 0, misses_ = 0;
};

struct Frame {
  int32_t node = 0;
  int32_t phase = 0;
  int32_t a = 0;  // literal / terminator position, object: last emitted property, utf-8 left
  int32_t b = 0;  // array: items so far
  bool operator==(const Frame&) const = default;
};
using Stack = std::vector<Frame>;

// The state of one output against a grammar. Copyable (the masker copies it per candidate).
class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const Grammar> grammar);
  // Consumes bytes; false (and the matcher is dead) when they cannot continue a valid output.
  bool Advance(std::string_view bytes);
  bool dead() const { return stacks_.empty(); }
  // The output so far is a complete match (EOS may come).
  bool Complete() const { return MinRemaining() == 0; }
  // Bytes of the shortest completion (INT64_MAX when dead).
  int64_t MinRemaining() const;
  const Grammar& grammar() const { return *grammar_; }

 private:
  friend class TokenMasker;
  void Step(Stack s, uint8_t c, std::vector<Stack>* out) const;
  int64_t StackRemaining(const Stack& s) const;
  int64_t FrameRemaining(const Frame& f, bool top) const;
  int64_t RequiredFrom(const Node& n, int from, bool first) const;
  bool AdvanceByte(uint8_t c);

  std::shared_ptr<const Grammar> grammar_;
  std::vector<Stack> stacks_;
};

// The vocabulary as a byte trie. Tokens with empty bytes and `excluded` ids (special / added
// tokens whose text the detokenizer drops or that carry protocol meaning) are never allowed.
class TokenMasker {
 public:
  TokenMasker(const std::vector<std::string>& token_bytes, const std::vector<int32_t>& excluded,
              int32_t eos_id);
  // allowed[id] = 1 when `id` may follow the matcher's state with `budget` tokens left after it.
  // EOS is allowed only when the output is complete. Returns how many ids are allowed.
  int Mask(const Matcher& m, int64_t budget, std::vector<uint8_t>* allowed) const;
  int32_t vocab_size() const { return static_cast<int32_t>(vocab_size_); }
  // The bytes of token `id` (empty for an unknown id).
  const std::string& bytes(int32_t id) const {
    static const std::string kEmpty;
    return id >= 0 && static_cast<size_t>(id) < bytes_.size() ? bytes_[static_cast<size_t>(id)]
                                                              : kEmpty;
  }
  int32_t eos_id() const { return eos_; }

 private:
  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
    std::vector<int32_t> ids;                       // tokens ending here
  };
  void Walk(int32_t node, const Matcher& m, int64_t budget, std::vector<uint8_t>* allowed,
            int* count) const;
  std::vector<TrieNode> trie_;
  std::vector<std::string> bytes_;
  size_t vocab_size_;
  int32_t eos_;
};

}  // namespace epd::grammar
