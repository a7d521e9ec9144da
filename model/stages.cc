#include "model/stages.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"

namespace epd::model {

int DecoderSplitLayer(const ModelConfig& c) { return c.candidate_source_layer; }

bool DSparkTargetsBelowSplit(const ModelConfig& c) {
  for (int l : c.dspark_target_layer_ids)
    if (l < DecoderSplitLayer(c)) return true;
  return false;
}

int64_t DecoderTailRows(const ModelConfig& c) {
  return c.window_size + std::max(0, c.dspark_block_size);
}

absl::StatusOr<EncoderOutput> EncoderPass(const Model& model, SequenceState& state,
                                          std::span<const int32_t> ids, int64_t tail_rows,
                                          const EncoderOutput* prev) {
  const ModelConfig& c = model.config();
  if (ids.empty()) return absl::InvalidArgumentError("encoder: no tokens");
  const int split = DecoderSplitLayer(c);
  const int64_t S = static_cast<int64_t>(ids.size()), start = state.pos;
  const int64_t D = c.dim, hc = c.hc_mult;
  Model::StageSpec spec;
  spec.start_pos = start;
  spec.last_layer = split;
  spec.per_row_keys = false;  // a prompt chunk is one reference call
  spec.compress_only_layer = split;
  const std::vector<int64_t> history_at_start = state.engram_history;
  Model::Hidden io;
  if (absl::Status s = model.RunStage(state, ids, spec, io); !s.ok()) return s;
  Model::Hidden none;
  if (absl::Status s = model.Commit(state, ids, start + S, none); !s.ok()) return s;
  // Tail: the previous output's rows (if contiguous) followed by this chunk's rows.
  EncoderOutput out;
  std::vector<int32_t> all_ids;
  std::vector<float> all_h, all_pre, all_mh;
  std::vector<int64_t> history;  // Engram ids before all_ids[0]
  if (prev != nullptr && prev->tail_start + prev->tail.rows == start) {
    all_ids = prev->tail_ids;
    all_h = prev->tail.h;
    all_pre = prev->tail.pre;
    all_mh = prev->tail.main_hidden;
    out.tail_start = prev->tail_start;
    history = prev->engram_history;
  } else {
    out.tail_start = start;
    history = history_at_start;
  }
  all_ids.insert(all_ids.end(), ids.begin(), ids.end());
  all_h.insert(all_h.end(), io.h.begin(), io.h.end());
  all_pre.insert(all_pre.end(), io.pre.begin(), io.pre.end());
  all_mh.insert(all_mh.end(), io.main_hidden.begin(), io.main_hidden.end());
  const int64_t total = static_cast<int64_t>(all_ids.size());
  const int64_t keep = std::min(total, tail_rows), drop = total - keep;
  out.tail_start += drop;
  for (int64_t i = 0; i < drop; ++i)
    history.push_back(EngramCompressedId(model.engram(), all_ids[i]));
  const size_t hist = static_cast<size_t>(std::max(0, c.engram_max_ngram_size - 1));
  if (history.size() > hist) history.erase(history.begin(), history.end() - hist);
  out.engram_history = std::move(history);
  out.tail_ids.assign(all_ids.begin() + drop, all_ids.end());
  out.tail.rows = keep;
  out.tail.h.assign(all_h.begin() + drop * hc * D, all_h.end());
  out.tail.pre.assign(all_pre.begin() + drop * hc, all_pre.end());
  // DSpark inputs of target layers below the split (the decoder fills the others).
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  if (DSparkTargetsBelowSplit(c))
    out.tail.main_hidden.assign(all_mh.begin() + drop * nt * D, all_mh.end());
  return out;
}

absl::Status EncoderReplay(const Model& model, SequenceState& state, std::span<const int32_t> ids,
                           std::span<const int32_t> history) {
  const ModelConfig& c = model.config();
  if (ids.empty()) return absl::OkStatus();
  const int64_t S = static_cast<int64_t>(ids.size());
  if (S > state.pos)
    return absl::InvalidArgumentError("encoder replay: more tokens than the prefix");
  const int split = DecoderSplitLayer(c);
  if (S > int64_t{split} * c.window_size)
    return absl::InvalidArgumentError("encoder replay: more than split x window tokens");
  std::vector<int64_t> hist;
  for (int32_t t : history) hist.push_back(EngramCompressedId(model.engram(), t));
  Model::StageSpec spec;
  spec.start_pos = state.pos - S;
  spec.last_layer = split;
  spec.window_floor = spec.start_pos;
  spec.per_row_keys = false;
  spec.engram_history = &hist;
  // The KV sources in [0, split) already hold their global KV; the replay's compressors append
  // throw-away entries and overwrite the tails, so the sources are restored afterwards (the
  // stored global KV is authoritative and exact).
  std::map<int, SequenceState::Source> saved = state.sources;
  const int published = state.published_keys;
  Model::Hidden io;
  absl::Status s = model.RunStage(state, ids, spec, io);
  state.sources = std::move(saved);
  state.published_keys = published;
  return s;
}

absl::StatusOr<ForwardResult> DecoderReplay(const Model& model, SequenceState& state,
                                            const EncoderOutput& enc) {
  const ModelConfig& c = model.config();
  const int64_t S = enc.tail.rows;
  if (S == 0) return absl::InvalidArgumentError("decoder replay: empty tail");
  if (enc.tail_start + S != state.pos) {
    return absl::FailedPreconditionError(absl::StrCat(
        "decoder replay: tail ends at ", enc.tail_start + S, ", state is at ", state.pos));
  }
  Model::StageSpec spec;
  spec.start_pos = enc.tail_start;
  spec.first_layer = DecoderSplitLayer(c);
  spec.window_floor = enc.tail_start;
  // The split layer's KV and Engram came from the encoder.
  spec.compress = false;
  spec.first_engram_done = true;
  spec.engram_history = &enc.engram_history;
  spec.per_row_keys = false;
  Model::Hidden io = enc.tail;
  if (absl::Status s = model.RunStage(state, enc.tail_ids, spec, io); !s.ok()) return s;
  ForwardResult res;
  auto logits = model.Head(io, false);
  if (!logits.ok()) return logits.status();
  res.logits = std::move(*logits);
  res.rows = 1;
  if (c.n_mtp_layers > 0) {
    if (absl::Status s = model.DSparkSeed(state, io.main_hidden.data(), S, enc.tail_start); !s.ok())
      return s;
  }
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  if (nt > 0) {
    state.main_hidden.assign(io.main_hidden.end() - nt * c.dim, io.main_hidden.end());
    state.main_hidden_pos = state.pos - 1;
    state.main_hidden_row = -1;
  }
  res.main_hidden = std::move(io.main_hidden);
  return res;
}

absl::StatusOr<std::vector<ForwardResult>> DecodeStep(const Model& model,
                                                      std::span<SequenceState* const> states,
                                                      std::span<const std::vector<int32_t>> tokens,
                                                      std::vector<absl::Status>* failed,
                                                      std::span<const LogitsRequest> outs) {
  if (states.size() != tokens.size()) {
    return absl::InvalidArgumentError("decode step: one token list per sequence");
  }
  if (!outs.empty() && outs.size() != states.size()) {
    return absl::InvalidArgumentError("decode step: one logits choice per sequence");
  }
  auto out_of = [&](size_t b) { return outs.empty() ? LogitsRequest() : outs[b]; };
  if (failed != nullptr) failed->assign(states.size(), absl::OkStatus());
  std::vector<ForwardResult> out(states.size());
  auto fail = [&](size_t b, const absl::Status& s) -> absl::Status {
    absl::Status st(s.code(), absl::StrCat("sequence ", b, ": ", s.message()));
    if (failed != nullptr) (*failed)[b] = st;
    return st;
  };
  // The sequences that can share one forward (Model::Batchable: the usual decode step) go through
  // Model::ExtendBatch, which reads the weights once for all of them (one sequence too: its
  // segments run as graphs on a backend that records them, model/step_graph.h); the rest one by
  // one.
  // A sequence whose logits request is bad fails alone, before any state changes.
  std::vector<size_t> batch, alone;
  for (size_t b = 0; b < states.size(); ++b) {
    if (absl::Status st =
            LogitsRequestProblem(out_of(b), static_cast<int64_t>(tokens[b].size()));
        !st.ok()) {
      absl::Status named = fail(b, st);
      if (failed == nullptr) return named;
      continue;
    }
    (model.Batchable(*states[b], tokens[b]) ? batch : alone).push_back(b);
  }
  if (!batch.empty()) {
    std::vector<SequenceState*> bs;
    std::vector<std::vector<int32_t>> bt;
    std::vector<LogitsRequest> bo;
    for (size_t b : batch) {
      bs.push_back(states[b]);
      bt.push_back(tokens[b]);
      bo.push_back(out_of(b));
    }
    std::vector<absl::Status> status;
    auto r = model.ExtendBatch(bs, bt, status, bo);
    for (size_t i = 0; i < batch.size(); ++i) {
      const absl::Status& st = r.ok() ? status[i] : r.status();
      if (!st.ok()) {
        absl::Status named = fail(batch[i], st);
        if (failed == nullptr) return named;
        continue;
      }
      out[batch[i]] = std::move((*r)[i]);
    }
  }
  std::sort(alone.begin(), alone.end());
  for (size_t b : alone) {
    auto r = model.Extend(*states[b], tokens[b], /*all_logits=*/true, nullptr,
                          Model::ExtendMode::kDecode, out_of(b));
    if (!r.ok()) {
      absl::Status named = fail(b, r.status());
      if (failed == nullptr) return named;
      continue;
    }
    out[b] = std::move(*r);
  }
  return out;
}

}  // namespace epd::model
