#include "runtime/worker/handoff.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/format.h"
#include "transfer/manifest.h"
#include "model/stages.h"

namespace epd::worker {
namespace {

namespace kf = kernels::format;
using model::StateSegment;

// Kind and layer of a segment from its name ("swa.5" -> SWA_KV, 5).
std::pair<epd::v1::SegmentKind, int> KindOf(const model::ModelConfig& c, const std::string& name) {
  const size_t dot = name.find('.');
  int layer = -1;
  if (dot != std::string::npos && !absl::SimpleAtoi(name.substr(dot + 1), &layer)) layer = -1;
  const std::string head = name.substr(0, dot);
  if (head == "swa")
    return {layer >= c.n_layers ? epd::v1::SEGMENT_DSPARK_DRAFT_KV : epd::v1::SEGMENT_SWA_KV,
            layer};
  if (head == "kv")
    return {layer == c.candidate_source_layer ? epd::v1::SEGMENT_DEC_GLOBAL_KV
                                              : epd::v1::SEGMENT_ENC_GLOBAL_KV,
            layer};
  if (head == "keys") return {epd::v1::SEGMENT_INDEX_K, layer};
  if (head == "tail") return {epd::v1::SEGMENT_COMPRESSOR_STATE, layer};
  if (head == "engram") return {epd::v1::SEGMENT_ENGRAM_HISTORY, -1};
  if (head == "main_hidden") return {epd::v1::SEGMENT_TARGET_HIDDEN, -1};
  if (head == "enc") return {epd::v1::SEGMENT_ENC_OUTPUT_TAIL, -1};
  return {epd::v1::SEGMENT_BLOCK, -1};  // meta, logits
}

void PutI64(std::vector<uint8_t>& b, int64_t v) {
  const size_t at = b.size();
  b.resize(at + 8);
  std::memcpy(b.data() + at, &v, 8);
}

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename T>
absl::Status FromBytes(const std::vector<uint8_t>& b, size_t n, const std::string& name,
                       std::vector<T>* out) {
  if (b.size() != n * sizeof(T))
    return absl::InvalidArgumentError(
        absl::StrCat("segment '", name, "': ", b.size(), " bytes, expected ", n * sizeof(T)));
  out->resize(n);
  if (n > 0) std::memcpy(out->data(), b.data(), b.size());
  return absl::OkStatus();
}

}  // namespace

std::vector<SegmentShape> ExpectedStateShapes(const model::ModelConfig& c, int64_t tokens,
                                              bool main_hidden) {
  std::vector<SegmentShape> out;
  const int64_t nsrc = static_cast<int64_t>(c.kv_source_layers.size());
  out.push_back({"meta", static_cast<uint64_t>(8 * (4 + 2 * nsrc))});
  const int64_t slot = kf::PackedSwaSlotBytes(c.head_dim);
  for (int l = 0; l < c.total_layers(); ++l)
    out.push_back({absl::StrCat("swa.", l), static_cast<uint64_t>(c.window_size * slot)});
  const int64_t eb = kf::PackedKvEntryBytes(c.head_dim);
  const int64_t kb = kf::PackedIndexKeyBytes(c.index_head_dim);
  std::vector<int> sources = c.kv_source_layers;
  std::sort(sources.begin(), sources.end());  // SerializeState walks a std::map
  for (int l : sources) {
    const int ratio = c.compress_ratios[l];
    const int64_t n = ratio > 0 ? tokens / ratio : 0;
    out.push_back({absl::StrCat("kv.", l), static_cast<uint64_t>(n * eb)});
    out.push_back({absl::StrCat("keys.", l), static_cast<uint64_t>(n * kb)});
    if (ratio > 1)
      out.push_back({absl::StrCat("tail.", l), static_cast<uint64_t>(2 * ratio * c.head_dim * 4)});
  }
  const int64_t keep = std::max(0, c.engram_max_ngram_size - 1);
  out.push_back({"engram", static_cast<uint64_t>(8 * std::min(tokens, keep))});
  const int64_t nt = static_cast<int64_t>(c.dspark_target_layer_ids.size());
  out.push_back({"main_hidden", static_cast<uint64_t>(main_hidden ? nt * c.dim * 2 : 0)});
  return out;
}

std::vector<SegmentShape> ExpectedEncoderOutputShapes(const model::ModelConfig& c, int64_t tokens,
                                                      int64_t tail_rows) {
  const uint64_t rows = static_cast<uint64_t>(std::min(tokens, tail_rows));
  const int64_t keep = std::max(0, c.engram_max_ngram_size - 1);
  const uint64_t hist = static_cast<uint64_t>(std::min(tokens - static_cast<int64_t>(rows), keep));
  return {{"enc.meta", 16},
          {"enc.ids", rows * 4},
          {"enc.h", rows * c.hc_mult * c.dim * 4},
          {"enc.pre", rows * c.hc_mult * 4},
          {"enc.hist", hist * 8},
          {"enc.mh", model::DSparkTargetsBelowSplit(c)
                         ? rows * c.dspark_target_layer_ids.size() * c.dim * 4
                         : 0}};
}

int64_t HandoffTailRows(const model::ModelConfig& c) { return model::DecoderTailRows(c); }

SegmentShape LogitsShape(const model::ModelConfig& c) {
  return {"logits", static_cast<uint64_t>(c.vocab_size * 4)};
}

std::vector<SegmentShape> ShapesOf(const std::vector<StateSegment>& segments) {
  std::vector<SegmentShape> out;
  out.reserve(segments.size());
  for (const StateSegment& s : segments) out.push_back({s.name, s.bytes.size()});
  return out;
}

std::vector<StateSegment> PackEncoderOutput(const model::EncoderOutput& o) {
  std::vector<StateSegment> out;
  StateSegment meta{"enc.meta", {}};
  PutI64(meta.bytes, o.tail_start);
  PutI64(meta.bytes, o.tail.rows);
  out.push_back(std::move(meta));
  out.push_back({"enc.ids", Bytes(o.tail_ids)});
  out.push_back({"enc.h", Bytes(o.tail.h)});
  out.push_back({"enc.pre", Bytes(o.tail.pre)});
  out.push_back({"enc.hist", Bytes(o.engram_history)});
  out.push_back({"enc.mh", Bytes(o.tail.main_hidden)});
  return out;
}

absl::StatusOr<model::EncoderOutput> UnpackEncoderOutput(const model::ModelConfig& c,
                                                         const std::vector<StateSegment>& segs) {
  std::map<std::string, const std::vector<uint8_t>*> by;
  for (const StateSegment& s : segs) by[s.name] = &s.bytes;
  for (const char* n : {"enc.meta", "enc.ids", "enc.h", "enc.pre", "enc.hist", "enc.mh"})
    if (!by.count(n)) return absl::NotFoundError(absl::StrCat("missing segment '", n, "'"));
  if (by["enc.meta"]->size() != 16)
    return absl::InvalidArgumentError("segment 'enc.meta': expected 16 bytes");
  model::EncoderOutput o;
  int64_t rows = 0;
  std::memcpy(&o.tail_start, by["enc.meta"]->data(), 8);
  std::memcpy(&rows, by["enc.meta"]->data() + 8, 8);
  if (rows < 0) return absl::InvalidArgumentError("segment 'enc.meta': negative rows");
  o.tail.rows = rows;
  const size_t r = static_cast<size_t>(rows);
  if (auto s = FromBytes(*by["enc.ids"], r, "enc.ids", &o.tail_ids); !s.ok()) return s;
  if (auto s = FromBytes(*by["enc.h"], r * c.hc_mult * c.dim, "enc.h", &o.tail.h); !s.ok())
    return s;
  if (auto s = FromBytes(*by["enc.pre"], r * c.hc_mult, "enc.pre", &o.tail.pre); !s.ok()) return s;
  const size_t hist = by["enc.hist"]->size() / 8;
  if (hist > static_cast<size_t>(std::max(0, c.engram_max_ngram_size - 1)))
    return absl::InvalidArgumentError("segment 'enc.hist': longer than the Engram history");
  if (auto s = FromBytes(*by["enc.hist"], hist, "enc.hist", &o.engram_history); !s.ok()) return s;
  const size_t mh =
      model::DSparkTargetsBelowSplit(c) ? r * c.dspark_target_layer_ids.size() * c.dim : 0;
  if (auto s = FromBytes(*by["enc.mh"], mh, "enc.mh", &o.tail.main_hidden); !s.ok()) return s;
  return o;
}

StateSegment PackLogits(const std::vector<float>& logits) { return {"logits", Bytes(logits)}; }

absl::StatusOr<std::vector<float>> UnpackLogits(const std::vector<StateSegment>& segs) {
  for (const StateSegment& s : segs) {
    if (s.name != "logits") continue;
    std::vector<float> out;
    if (auto st = FromBytes(s.bytes, s.bytes.size() / 4, "logits", &out); !st.ok()) return st;
    return out;
  }
  return absl::NotFoundError("missing segment 'logits'");
}

epd::v1::Manifest BuildHandoffManifest(const model::ModelConfig& c, const HandoffHeader& h,
                                       const std::vector<SegmentShape>& shapes) {
  epd::v1::Manifest m;
  m.set_request_id(h.request_id);
  m.set_config_fingerprint(h.config_fingerprint);
  m.set_prompt_length(h.prompt_length);
  m.set_cached_length(h.cached_length);
  m.set_dspark(h.dspark);
  for (const SegmentShape& s : shapes) {
    auto [kind, layer] = KindOf(c, s.name);
    transfer::AddRawBytesSegment(m, kind, layer, 0, h.prompt_length, s.bytes);
  }
  return m;
}

absl::Status HandoffPeer::WaitFor(transfer::TransferId id, absl::Duration deadline,
                                  const std::atomic<bool>* cancelled) {
  const absl::Time end = absl::Now() + deadline + absl::Seconds(2);
  while (true) {
    const absl::Status st = transport_.Wait(id, absl::Milliseconds(50));
    auto status = transport_.Status(id);
    if (!status.ok()) return st.ok() ? status.status() : st;
    if (status->state == transfer::TransferState::kDone ||
        status->state == transfer::TransferState::kFailed)
      return status->error;
    if (cancelled != nullptr && cancelled->load()) {
      transport_.Cancel(id, "request cancelled");
      return absl::CancelledError("request cancelled");
    }
    if (absl::Now() > end) {
      transport_.Cancel(id, "hand-off deadline");
      return absl::DeadlineExceededError("hand-off deadline passed");
    }
  }
}

absl::Status HandoffPeer::Send(const std::string& address, epd::v1::Manifest manifest,
                               const std::vector<StateSegment>& segments, absl::Duration deadline,
                               const std::atomic<bool>* cancelled) {
  auto id = Offer(address, std::move(manifest), segments, deadline);
  if (!id.ok()) return id.status();
  return AwaitSent(address, *id, deadline, cancelled);
}

absl::StatusOr<std::vector<StateSegment>> HandoffPeer::Receive(
    const epd::v1::Manifest& expected, const std::vector<SegmentShape>& shapes,
    absl::Duration deadline, const std::atomic<bool>* cancelled) {
  auto id = Post(expected, shapes, deadline);
  if (!id.ok()) return id.status();
  if (absl::Status st = WaitFor(*id, deadline, cancelled); !st.ok()) {
    transport_.Forget(*id);
    return st;
  }
  auto got = transport_.TakeReceived(*id);
  if (!got.ok()) return got.status();
  std::vector<StateSegment> out;
  out.reserve(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    const uint8_t* p = got->buffer->data() + got->segment_offsets[i];
    out.push_back({shapes[i].name, std::vector<uint8_t>(p, p + shapes[i].bytes)});
  }
  return out;
}

// ---- Streamed hand-offs ----

namespace {

std::vector<SegmentShape> ShapesOfGroup(const std::vector<SegmentShape>& shapes,
                                        const std::vector<StreamPiece>& pieces) {
  std::vector<SegmentShape> out;
  out.reserve(pieces.size());
  for (const StreamPiece& p : pieces) out.push_back({shapes[p.shape].name, p.bytes});
  return out;
}

// The error of one group, named; its payloads (transfer/transfer_error.h) are kept.
absl::Status InGroup(const absl::Status& s, int group, int groups) {
  absl::Status out(s.code(),
                   absl::StrCat(s.message(), " (streamed group ", group, " of ", groups + 1, ")"));
  s.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

// The KV source layer of "kv.<L>" / "keys.<L>", else -1.
int KvRowsLayer(const std::string& name) {
  int layer = -1;
  if (absl::StartsWith(name, "kv.")) {
    if (!absl::SimpleAtoi(name.substr(3), &layer)) return -1;
  } else if (absl::StartsWith(name, "keys.")) {
    if (!absl::SimpleAtoi(name.substr(5), &layer)) return -1;
  }
  return layer;
}

}  // namespace

int64_t StreamChunkTokens(const model::ModelConfig& c) {
  int64_t chunk = 1024;
  for (int l : c.kv_source_layers) {
    const int64_t r = c.compress_ratios[l];
    if (r > 0 && chunk % r != 0) chunk = (chunk / r + 1) * r;
  }
  return chunk;
}

int StreamGroups(int64_t tokens, int64_t chunk_tokens) {
  if (tokens <= 0 || chunk_tokens <= 0) return 0;
  return static_cast<int>((tokens + chunk_tokens - 1) / chunk_tokens - 1);
}

std::string StreamRequestId(const std::string& request_id, int group, int groups) {
  return absl::StrCat(request_id, "#g", group, "/", groups);
}

absl::StatusOr<std::vector<std::vector<StreamPiece>>> StreamPlan(
    const model::ModelConfig& c, int64_t tokens, int64_t chunk,
    const std::vector<SegmentShape>& shapes) {
  if (chunk <= 0) return absl::InvalidArgumentError("stream plan: chunk_tokens must be positive");
  const int groups = StreamGroups(tokens, chunk);
  std::vector<std::vector<StreamPiece>> plan(static_cast<size_t>(groups) + 1);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int layer = KvRowsLayer(shapes[i].name);
    const int64_t ratio = layer >= 0 && layer < static_cast<int>(c.compress_ratios.size())
                              ? c.compress_ratios[layer]
                              : 0;
    const int64_t rows = ratio > 0 ? tokens / ratio : 0;
    if (rows == 0 || groups == 0) {
      plan.back().push_back({i, 0, shapes[i].bytes});
      continue;
    }
    if (chunk % ratio != 0)
      return absl::InvalidArgumentError(absl::StrCat("stream plan: chunk_tokens ", chunk,
                                                     " is not a multiple of layer ", layer,
                                                     "'s ratio ", ratio));
    if (shapes[i].bytes % static_cast<uint64_t>(rows) != 0)
      return absl::InvalidArgumentError(
          absl::StrCat("stream plan: segment '", shapes[i].name, "' is not ", rows, " equal rows"));
    const uint64_t row_bytes = shapes[i].bytes / static_cast<uint64_t>(rows);
    const uint64_t per_group = static_cast<uint64_t>(chunk / ratio) * row_bytes;
    for (int g = 0; g < groups; ++g)
      plan[static_cast<size_t>(g)].push_back({i, per_group * static_cast<uint64_t>(g), per_group});
    const uint64_t done = per_group * static_cast<uint64_t>(groups);
    plan.back().push_back({i, done, shapes[i].bytes - done});
  }
  return plan;
}

HandoffStreamSender::HandoffStreamSender(HandoffPeer& peer, const model::ModelConfig& config,
                                         std::string address, HandoffHeader header,
                                         std::vector<SegmentShape> shapes, absl::Duration deadline,
                                         const std::atomic<bool>* cancelled, int64_t chunk_tokens)
    : peer_(peer),
      config_(config),
      address_(std::move(address)),
      header_(std::move(header)),
      shapes_(std::move(shapes)),
      deadline_(deadline),
      cancelled_(cancelled),
      chunk_tokens_(chunk_tokens > 0 ? chunk_tokens : StreamChunkTokens(config)) {
  auto plan = StreamPlan(config_, header_.prompt_length, chunk_tokens_, shapes_);
  if (plan.ok()) {
    plan_ = *std::move(plan);
    groups_ = static_cast<int>(plan_.size()) - 1;
  } else {
    plan_status_ = plan.status();
  }
}

HandoffStreamSender::~HandoffStreamSender() {
  if (!finished_) Abort("hand-off abandoned");
}

absl::Status HandoffStreamSender::Offer(int g, const std::vector<StateSegment>& from) {
  std::map<std::string, const std::vector<uint8_t>*> by;
  for (const StateSegment& s : from) by[s.name] = &s.bytes;
  std::vector<StateSegment> segs;
  segs.reserve(plan_[static_cast<size_t>(g)].size());
  for (const StreamPiece& p : plan_[static_cast<size_t>(g)]) {
    const std::string& name = shapes_[p.shape].name;
    auto it = by.find(name);
    if (it == by.end() || it->second->size() < p.offset + p.bytes) {
      return absl::InternalError(absl::StrCat(
          "streamed hand-off: segment '", name, "' has ", it == by.end() ? 0 : it->second->size(),
          " bytes, group ", g, " needs [", p.offset, ", ", p.offset + p.bytes, ")"));
    }
    const uint8_t* b = it->second->data() + p.offset;
    segs.push_back({name, std::vector<uint8_t>(b, b + p.bytes)});
  }
  HandoffHeader h = header_;
  h.request_id = StreamRequestId(header_.request_id, g, groups_);
  auto id =
      peer_.Offer(address_, BuildHandoffManifest(config_, h, ShapesOf(segs)), segs, deadline_);
  if (!id.ok()) return id.status();
  offered_.push_back(*id);
  ++next_group_;
  return absl::OkStatus();
}

absl::Status HandoffStreamSender::SendReady(const std::vector<StateSegment>& kv, int64_t pos) {
  if (finished_) return absl::FailedPreconditionError("streamed hand-off already ended");
  if (!plan_status_.ok()) return plan_status_;
  while (next_group_ < groups_ && (next_group_ + 1) * chunk_tokens_ <= pos) {
    const int g = next_group_;
    if (absl::Status st = Offer(g, kv); !st.ok()) {
      Abort("a group could not be offered");
      return InGroup(st, g, groups_);
    }
  }
  return absl::OkStatus();
}

absl::Status HandoffStreamSender::Finish(const std::vector<StateSegment>& whole) {
  if (finished_) return absl::FailedPreconditionError("streamed hand-off already ended");
  if (!plan_status_.ok()) {
    Abort("no plan");
    return plan_status_;
  }
  // Every byte the encoder computed is in the plan, and only those: the hand-off equals the plan's
  // shapes segment by segment (what a whole hand-off's manifest check would refuse, refused here).
  std::map<std::string, uint64_t> have;
  for (const StateSegment& s : whole) have[s.name] = s.bytes.size();
  for (const SegmentShape& want : shapes_) {
    auto it = have.find(want.name);
    if (it == have.end() || it->second != want.bytes) {
      Abort("the hand-off does not match its plan");
      return absl::FailedPreconditionError(absl::StrCat(
          "streamed hand-off: segment '", want.name, "' has ", it == have.end() ? 0 : it->second,
          " bytes, the plan for ", header_.prompt_length, " positions has ", want.bytes));
    }
    have.erase(it);
  }
  if (!have.empty()) {
    Abort("the hand-off does not match its plan");
    return absl::FailedPreconditionError(
        absl::StrCat("streamed hand-off: segment '", have.begin()->first, "' is not in the plan"));
  }
  while (next_group_ <= groups_) {
    const int g = next_group_;
    if (absl::Status st = Offer(g, whole); !st.ok()) {
      Abort("a group could not be offered");
      return InGroup(st, g, groups_);
    }
  }
  for (size_t g = 0; g < offered_.size(); ++g) {
    absl::Status st = peer_.AwaitSent(address_, offered_[g], deadline_, cancelled_);
    if (!st.ok()) {
      for (size_t rest = g + 1; rest < offered_.size(); ++rest)
        peer_.CancelAndForget(offered_[rest], "an earlier group of the hand-off failed");
      offered_.clear();
      finished_ = true;
      return InGroup(st, static_cast<int>(g), groups_);
    }
  }
  offered_.clear();
  finished_ = true;
  return absl::OkStatus();
}

void HandoffStreamSender::Abort(const std::string& reason) {
  for (transfer::TransferId id : offered_) peer_.CancelAndForget(id, reason);
  offered_.clear();
  finished_ = true;
}

absl::StatusOr<transfer::PeerId> HandoffPeer::PeerFor(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(address);
  if (it != peers_.end()) return it->second;
  auto p = transport_.Connect(address, absl::Seconds(10));
  if (!p.ok()) return p.status();
  peers_[address] = *p;
  return *p;
}

void HandoffPeer::DropPeer(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_.erase(address);  // reconnect next time
}

absl::StatusOr<transfer::TransferId> HandoffPeer::Offer(const std::string& address,
                                                        epd::v1::Manifest manifest,
                                                        const std::vector<StateSegment>& segments,
                                                        absl::Duration deadline) {
  auto peer = PeerFor(address);
  if (!peer.ok()) return peer.status();
  uint64_t total = 0;
  for (const StateSegment& s : segments) total += s.bytes.size();
  auto buf = transport_.Allocate(total);
  if (!buf.ok()) return buf.status();
  uint64_t at = 0;
  for (const StateSegment& s : segments) {
    if (!s.bytes.empty()) std::memcpy((*buf)->data() + at, s.bytes.data(), s.bytes.size());
    at += s.bytes.size();
  }
  transfer::TransferOptions opts;
  opts.deadline = deadline;
  opts.lease = deadline;
  auto id = transport_.Send(*peer, std::move(manifest), std::move(*buf), opts);
  if (!id.ok() && (absl::IsUnavailable(id.status()) || absl::IsNotFound(id.status())))
    DropPeer(address);
  return id;
}

absl::Status HandoffPeer::AwaitSent(const std::string& address, transfer::TransferId id,
                                    absl::Duration deadline, const std::atomic<bool>* cancelled) {
  absl::Status st = WaitFor(id, deadline, cancelled);
  transport_.Forget(id);
  if (absl::IsUnavailable(st)) DropPeer(address);
  return st;
}

void HandoffPeer::CancelAndForget(transfer::TransferId id, const std::string& reason) {
  transport_.Cancel(id, reason);
  transport_.Forget(id);
}

absl::StatusOr<transfer::TransferId> HandoffPeer::Post(const epd::v1::Manifest& manifest,
                                                       const std::vector<SegmentShape>& shapes,
                                                       absl::Duration deadline) {
  uint64_t total = 0;
  for (const SegmentShape& s : shapes) total += s.bytes;
  auto buf = transport_.Allocate(total);
  if (!buf.ok()) return buf.status();
  transfer::TransferOptions opts;
  opts.deadline = deadline;
  opts.lease = deadline;
  return transport_.Receive(manifest, std::move(*buf), opts);
}

absl::StatusOr<std::vector<StateSegment>> HandoffPeer::ReceiveStreamable(
    const model::ModelConfig& config, const HandoffHeader& header,
    const std::vector<SegmentShape>& shapes, absl::Duration deadline,
    const std::atomic<bool>* cancelled, bool* streamed_out, int64_t chunk_tokens) {
  auto planned = StreamPlan(config, header.prompt_length,
                            chunk_tokens > 0 ? chunk_tokens : StreamChunkTokens(config), shapes);
  if (!planned.ok()) return planned.status();
  const std::vector<std::vector<StreamPiece>>& plan = *planned;
  const int groups = static_cast<int>(plan.size()) - 1;
  auto group_manifest = [&](int g) {
    HandoffHeader h = header;
    h.request_id = StreamRequestId(header.request_id, g, groups);
    return BuildHandoffManifest(config, h, ShapesOfGroup(shapes, plan[static_cast<size_t>(g)]));
  };
  auto whole = Post(BuildHandoffManifest(config, header, shapes), shapes, deadline);
  if (!whole.ok()) return whole.status();
  auto first = Post(group_manifest(0), ShapesOfGroup(shapes, plan[0]), deadline);
  if (!first.ok()) {
    CancelAndForget(*whole, "hand-off receive failed");
    return first.status();
  }
  // The offer that matches decides how the sender sends (the engine's own deadline ends a receive
  // nobody offers; its error is then the answer).
  bool streamed = false;
  const absl::Time end = absl::Now() + deadline + absl::Seconds(2);
  while (true) {
    (void)transport_.Wait(*whole, absl::Milliseconds(5));
    auto sw = transport_.Status(*whole);
    auto s0 = transport_.Status(*first);
    if (!sw.ok() || !s0.ok()) {
      CancelAndForget(*whole, "hand-off receive failed");
      CancelAndForget(*first, "hand-off receive failed");
      return !sw.ok() ? sw.status() : s0.status();
    }
    if (sw->state != transfer::TransferState::kExpecting) break;
    if (s0->state != transfer::TransferState::kExpecting) {
      streamed = true;
      break;
    }
    const bool was_cancelled = cancelled != nullptr && cancelled->load();
    if (was_cancelled || absl::Now() > end) {
      CancelAndForget(*whole, was_cancelled ? "request cancelled" : "hand-off deadline");
      CancelAndForget(*first, was_cancelled ? "request cancelled" : "hand-off deadline");
      return was_cancelled ? absl::CancelledError("request cancelled")
                           : absl::DeadlineExceededError("hand-off deadline passed");
    }
  }
  if (streamed_out != nullptr) *streamed_out = streamed;
  std::vector<StateSegment> out(shapes.size());
  if (!streamed) {
    CancelAndForget(*first, "the hand-off came whole");
    if (absl::Status st = WaitFor(*whole, deadline, cancelled); !st.ok()) {
      transport_.Forget(*whole);
      return st;
    }
    auto got = transport_.TakeReceived(*whole);
    if (!got.ok()) return got.status();
    for (size_t i = 0; i < shapes.size(); ++i) {
      const uint8_t* p = got->buffer->data() + got->segment_offsets[i];
      out[i] = {shapes[i].name, std::vector<uint8_t>(p, p + shapes[i].bytes)};
    }
    return out;
  }
  CancelAndForget(*whole, "the hand-off is streamed");
  for (size_t i = 0; i < shapes.size(); ++i)
    out[i] = {shapes[i].name, std::vector<uint8_t>(shapes[i].bytes)};
  std::vector<transfer::TransferId> ids = {*first};
  for (int g = 1; g <= groups; ++g) {
    auto id =
        Post(group_manifest(g), ShapesOfGroup(shapes, plan[static_cast<size_t>(g)]), deadline);
    if (!id.ok()) {
      for (transfer::TransferId posted : ids) CancelAndForget(posted, "hand-off receive failed");
      return InGroup(id.status(), g, groups);
    }
    ids.push_back(*id);
  }
  for (size_t g = 0; g < ids.size(); ++g) {
    absl::Status st = WaitFor(ids[g], deadline, cancelled);
    if (st.ok()) {
      auto got = transport_.TakeReceived(ids[g]);
      if (got.ok()) {
        // Each piece lands at its offset of the whole segment.
        const std::vector<StreamPiece>& pieces = plan[g];
        for (size_t j = 0; j < pieces.size(); ++j) {
          if (pieces[j].bytes == 0) continue;
          std::memcpy(out[pieces[j].shape].bytes.data() + pieces[j].offset,
                      got->buffer->data() + got->segment_offsets[j], pieces[j].bytes);
        }
      } else {
        st = got.status();
      }
    } else {
      transport_.Forget(ids[g]);
    }
    if (!st.ok()) {
      for (size_t rest = g + 1; rest < ids.size(); ++rest)
        CancelAndForget(ids[rest], "an earlier group of the hand-off failed");
      return InGroup(st, static_cast<int>(g), groups);
    }
  }
  return out;
}

}  // namespace epd::worker
