// Streamed encoder -> prefill hand-offs (runtime/worker/handoff.h, docs/transfer.md): the encoder
// run in chunks gives the same bytes as one pass and each chunk's KV rows are final once it ran;
// the group plan covers every byte once; a streamed hand-off arrives bit-identical to a whole one
// (and the receiver takes either); a corrupted byte in group 2, a sender that disconnects in the
// middle of group 2 and a sender that vanishes between groups all fail the request on both sides
// with every buffer released.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <thread>

#include "common/clock.h"
#include "encoder_pool/encoder_stage.h"
#include "transfer/fault_wire.h"
#include "tests/testing/loopback_wire.h"
#include "transfer/transfer_engine.h"
#include "transfer/transfer_error.h"
#include "model/model.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "runtime/worker/handoff.h"
#include "tests/testing/nano_model.h"

namespace epd {
namespace {

using model::StateSegment;

std::vector<int32_t> Prompt(int n) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 10 + (i * 41) % 250;
  return p;
}

class StreamedHandoffTest : public testing::NanoModelTest {
 protected:
  // The encoder's hand-off for `prompt` (state then encoder output), computed once per prompt.
  struct Handoff {
    std::vector<StateSegment> segments;
    std::vector<worker::SegmentShape> expected;  // what the receiver derives on its own
  };
  static Handoff Encode(const std::vector<int32_t>& prompt) {
    const model::ModelConfig& c = model_->config();
    encoder_pool::EncoderStage enc(*model_, worker::HandoffTailRows(c));
    auto e = enc.Run(prompt);
    EXPECT_TRUE(e.ok()) << e.status();
    Handoff h;
    h.segments = e->state;
    for (auto& s : worker::PackEncoderOutput(e->output)) h.segments.push_back(std::move(s));
    const int64_t n = static_cast<int64_t>(prompt.size());
    h.expected = worker::ExpectedStateShapes(c, n, false);
    for (auto& s : worker::ExpectedEncoderOutputShapes(c, n, worker::HandoffTailRows(c)))
      h.expected.push_back(s);
    return h;
  }
  static constexpr int64_t kChunk = 128;  // small chunks: several groups on short prompts

  // Non-empty pieces (= data messages) of groups [0, g).
  static int PiecesBefore(const Handoff& h, int64_t tokens, int g) {
    auto plan = worker::StreamPlan(model_->config(), tokens, kChunk, h.expected);
    EXPECT_TRUE(plan.ok()) << plan.status();
    int n = 0;
    for (int i = 0; i < g; ++i)
      for (const worker::StreamPiece& p : (*plan)[i]) n += p.bytes > 0 ? 1 : 0;
    return n;
  }

  // Two engines on one loopback network; the sender's wire optionally under a fault plan.
  void MakeEngines(transfer::FaultPlan plan = {}, absl::Duration release_grace = absl::Seconds(1)) {
    net_ = transfer::MakeLoopbackNetwork();
    transfer::EngineOptions o;
    o.config_fingerprint = "fp";
    o.cluster_token = "tok";
    o.release_grace = release_grace;
    auto wire = transfer::MakeLoopbackWire(net_, "tx");
    if (plan.action != transfer::FaultPlan::Action::kNone)
      wire = transfer::MakeFaultWire(std::move(wire), plan);
    auto tx =
        transfer::TransferEngine::Create(std::move(wire), o, registry_, common::SystemClock::Get());
    auto rx = transfer::TransferEngine::Create(transfer::MakeLoopbackWire(net_, "rx"), o, registry_,
                                               common::SystemClock::Get());
    ASSERT_TRUE(tx.ok() && rx.ok());
    tx_ = *std::move(tx);
    rx_ = *std::move(rx);
    sender_ = std::make_unique<worker::HandoffPeer>(*tx_);
    receiver_ = std::make_unique<worker::HandoffPeer>(*rx_);
  }

  // Waits (bounded) until `t` holds nothing: no buffer, registration, transfer or wire operation.
  static bool Drained(const transfer::KvTransport& t) {
    for (int i = 0; i < 400; ++i) {
      const transfer::ResourceCounts r = t.Resources();
      if (r.allocations == 0 && r.registrations == 0 && r.live_transfers == 0 && r.wire_ops == 0)
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return false;
  }
  // Waits (bounded) until every offered transfer of the sender has ended.
  static void WaitSenderIdle(const transfer::KvTransport& t) {
    for (int i = 0; i < 400 && t.Resources().live_transfers > 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  prometheus::Registry registry_;
  std::shared_ptr<transfer::LoopbackNetwork> net_;
  std::unique_ptr<transfer::TransferEngine> tx_, rx_;
  std::unique_ptr<worker::HandoffPeer> sender_, receiver_;
};

TEST_F(StreamedHandoffTest, PlanCoversEveryByteOnceInChunkGroups) {
  const model::ModelConfig& c = model_->config();
  EXPECT_EQ(worker::StreamChunkTokens(c) % 2, 0);
  EXPECT_EQ(worker::StreamGroups(700, kChunk), 5);
  EXPECT_EQ(worker::StreamGroups(640, kChunk), 4);
  EXPECT_EQ(worker::StreamGroups(100, kChunk), 0);
  Handoff h = Encode(Prompt(700));
  auto plan = worker::StreamPlan(c, 700, kChunk, h.expected);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 6u);
  std::vector<uint64_t> covered(h.expected.size(), 0);
  for (size_t g = 0; g < plan->size(); ++g) {
    for (const worker::StreamPiece& p : (*plan)[g]) {
      const std::string& name = h.expected[p.shape].name;
      if (g + 1 < plan->size()) {
        // Early groups: only global KV rows and index keys, one chunk's worth each.
        EXPECT_TRUE(name.rfind("kv.", 0) == 0 || name.rfind("keys.", 0) == 0) << name;
        EXPECT_GT(p.bytes, 0u) << name;
      }
      EXPECT_EQ(p.offset, covered[p.shape]) << name << " group " << g;  // contiguous, in order
      covered[p.shape] += p.bytes;
    }
  }
  for (size_t i = 0; i < covered.size(); ++i)
    EXPECT_EQ(covered[i], h.expected[i].bytes) << h.expected[i].name;
  // The final group lists every segment, in hand-off order.
  ASSERT_EQ(plan->back().size(), h.expected.size());
  for (size_t i = 0; i < h.expected.size(); ++i) EXPECT_EQ(plan->back()[i].shape, i);
  EXPECT_EQ(worker::StreamRequestId("r", 2, 5), "r#g2/5");
  // A chunk that is not a multiple of a source's ratio is refused.
  EXPECT_FALSE(worker::StreamPlan(c, 700, 127, h.expected).ok());
}

// Chunking does not change the encoder's bytes, and the KV rows of a chunk are final once the
// chunk ran (what the streamed hand-off sends early is what a whole one would carry).
TEST_F(StreamedHandoffTest, ChunkedEncoderEqualsOnePassAndChunkRowsAreFinal) {
  const model::ModelConfig& c = model_->config();
  const std::vector<int32_t> prompt = Prompt(600);
  encoder_pool::EncoderStage enc(*model_, worker::HandoffTailRows(c));
  auto plain = enc.Run(prompt);
  ASSERT_TRUE(plain.ok()) << plain.status();

  std::vector<int64_t> positions;
  std::vector<std::map<std::string, std::vector<uint8_t>>> snapshots;
  encoder_pool::ChunkOptions chunks;
  chunks.chunk_tokens = kChunk;
  chunks.after_chunk = [&](const model::SequenceState& st) {
    positions.push_back(st.pos);
    std::map<std::string, std::vector<uint8_t>> kv;
    for (auto& s : model::SerializeStateSegments(c, st, [](const std::string& n) {
           return n.rfind("kv.", 0) == 0 || n.rfind("keys.", 0) == 0;
         }))
      kv[s.name] = std::move(s.bytes);
    snapshots.push_back(std::move(kv));
    return absl::OkStatus();
  };
  encoder_pool::PrefixReport report;
  auto chunked = enc.Run(prompt, {}, &report, &chunks);
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  EXPECT_EQ(positions, (std::vector<int64_t>{128, 256, 384, 512, 600}));
  ASSERT_EQ(chunked->state.size(), plain->state.size());
  std::map<std::string, const std::vector<uint8_t>*> final_bytes;
  for (size_t i = 0; i < plain->state.size(); ++i) {
    EXPECT_EQ(chunked->state[i].name, plain->state[i].name);
    EXPECT_EQ(chunked->state[i].bytes, plain->state[i].bytes) << plain->state[i].name;
    final_bytes[plain->state[i].name] = &plain->state[i].bytes;
  }
  EXPECT_EQ(chunked->output.tail.h, plain->output.tail.h);
  EXPECT_EQ(chunked->output.tail_ids, plain->output.tail_ids);
  EXPECT_EQ(chunked->output.engram_history, plain->output.engram_history);
  int checked = 0;
  for (const auto& snap : snapshots) {
    for (const auto& [name, bytes] : snap) {
      const std::vector<uint8_t>& want = *final_bytes.at(name);
      ASSERT_LE(bytes.size(), want.size()) << name;
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), want.begin()))
          << name << ": rows changed after their chunk ran";
      ++checked;
    }
  }
  EXPECT_GE(checked, 5 * 6);

  // A callback error stops the run and is its result.
  chunks.after_chunk = [](const model::SequenceState& st) {
    return st.pos >= 256 ? absl::UnavailableError("peer gone") : absl::OkStatus();
  };
  auto stopped = enc.Run(prompt, {}, &report, &chunks);
  ASSERT_FALSE(stopped.ok());
  EXPECT_EQ(stopped.status().message(), "peer gone");
}

// Streamed (sent from the encoder's chunk callback while it computes) and whole hand-offs arrive
// bit-identical through the same receive call.
TEST_F(StreamedHandoffTest, StreamedAndWholeHandoffsArriveIdentical) {
  MakeEngines();
  const model::ModelConfig& c = model_->config();
  const std::vector<int32_t> prompt = Prompt(500);
  Handoff h = Encode(prompt);
  for (bool streamed : {true, false}) {
    const std::string rid = streamed ? "r-stream" : "r-whole";
    worker::HandoffHeader header{rid, "fp", 500, 0, false};
    absl::Status sent;
    std::thread t([&] {
      if (!streamed) {
        sent = sender_->Send(rx_->LocalAddress(),
                             worker::BuildHandoffManifest(c, header, worker::ShapesOf(h.segments)),
                             h.segments, absl::Seconds(10), nullptr);
        return;
      }
      worker::HandoffStreamSender s(*sender_, c, rx_->LocalAddress(), header, h.expected,
                                    absl::Seconds(10), nullptr, kChunk);
      EXPECT_EQ(s.groups(), 3);
      encoder_pool::EncoderStage enc(*model_, worker::HandoffTailRows(c));
      encoder_pool::ChunkOptions chunks;
      chunks.chunk_tokens = kChunk;
      chunks.after_chunk = [&](const model::SequenceState& st) {
        return s.SendReady(model::SerializeState(c, st), st.pos);
      };
      encoder_pool::PrefixReport report;
      auto e = enc.Run(prompt, {}, &report, &chunks);
      if (!e.ok()) {
        sent = e.status();
        return;
      }
      EXPECT_EQ(s.sent(), 3);  // every early group left before the pass ended
      std::vector<StateSegment> whole = e->state;
      for (auto& x : worker::PackEncoderOutput(e->output)) whole.push_back(std::move(x));
      sent = s.Finish(whole);
    });
    bool was_streamed = !streamed;
    auto got = receiver_->ReceiveStreamable(c, header, h.expected, absl::Seconds(10), nullptr,
                                            &was_streamed, kChunk);
    t.join();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(sent.ok()) << sent;
    EXPECT_EQ(was_streamed, streamed);
    ASSERT_EQ(got->size(), h.segments.size());
    for (size_t i = 0; i < got->size(); ++i) {
      EXPECT_EQ((*got)[i].name, h.segments[i].name);
      EXPECT_EQ((*got)[i].bytes, h.segments[i].bytes) << h.segments[i].name;
    }
  }
  EXPECT_TRUE(Drained(*tx_));
  EXPECT_TRUE(Drained(*rx_));
}

// A hand-off whose bytes differ from the plan is refused by the sender (no byte is dropped or
// padded), and the receiver fails with every buffer freed.
TEST_F(StreamedHandoffTest, HandoffThatDoesNotMatchThePlanIsRefused) {
  MakeEngines();
  const model::ModelConfig& c = model_->config();
  Handoff h = Encode(Prompt(300));
  worker::HandoffHeader header{"r-plan", "fp", 300, 0, false};
  absl::StatusOr<std::vector<StateSegment>> got = absl::UnknownError("unset");
  std::thread rx([&] {
    got = receiver_->ReceiveStreamable(c, header, h.expected, absl::Seconds(3), nullptr, nullptr,
                                       kChunk);
  });
  std::vector<StateSegment> whole = h.segments;
  whole.back().bytes.push_back(0);  // one byte more than the plan
  absl::Status sent;
  {
    worker::HandoffStreamSender s(*sender_, c, rx_->LocalAddress(), header, h.expected,
                                  absl::Seconds(10), nullptr, kChunk);
    ASSERT_TRUE(s.SendReady(h.segments, 256).ok());
    sent = s.Finish(whole);
  }
  rx.join();
  EXPECT_TRUE(absl::IsFailedPrecondition(sent)) << sent;
  EXPECT_NE(std::string(sent.message()).find(whole.back().name), std::string::npos) << sent;
  EXPECT_FALSE(got.ok());
  EXPECT_TRUE(Drained(*tx_));
  EXPECT_TRUE(Drained(*rx_));
}

// Sends groups 0 and 1 (each confirmed before the next), then the rest without waiting; returns
// the receiver's and the sender's outcome.
struct Outcome {
  absl::StatusOr<std::vector<StateSegment>> received = absl::UnknownError("unset");
  absl::Status sent;
};

TEST_F(StreamedHandoffTest, CorruptedByteInGroupTwoFailsTheRequestCleanly) {
  const model::ModelConfig& c = model_->config();
  Handoff h = Encode(Prompt(700));
  transfer::FaultPlan plan;
  plan.action = transfer::FaultPlan::Action::kCorrupt;
  plan.target = transfer::FaultPlan::Target::kData;
  plan.nth = PiecesBefore(h, 700, 2);  // the first data message of group 2
  plan.corrupt_offset = 17;
  MakeEngines(plan);
  worker::HandoffHeader header{"r-corrupt", "fp", 700, 0, false};
  Outcome out;
  std::thread rx([&] {
    out.received = receiver_->ReceiveStreamable(c, header, h.expected, absl::Seconds(10), nullptr,
                                                nullptr, kChunk);
  });
  {
    worker::HandoffStreamSender s(*sender_, c, rx_->LocalAddress(), header, h.expected,
                                  absl::Seconds(10), nullptr, kChunk);
    ASSERT_EQ(s.groups(), 5);
    for (int64_t pos = kChunk; pos <= 5 * kChunk && out.sent.ok(); pos += kChunk) {
      out.sent = s.SendReady(h.segments, pos);
      if (pos <= 2 * kChunk) WaitSenderIdle(*tx_);  // groups 0, 1 land before group 2 leaves
    }
    if (out.sent.ok()) out.sent = s.Finish(h.segments);
  }
  rx.join();
  ASSERT_FALSE(out.received.ok());
  const std::string msg(out.received.status().message());
  EXPECT_NE(msg.find("checksum"), std::string::npos) << msg;
  EXPECT_NE(msg.find("streamed group 2 of 6"), std::string::npos) << msg;
  // The engine's machine-readable cause survives the group's naming.
  auto info = transfer::TransferErrorOf(out.received.status());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->reason, "checksum");
  EXPECT_FALSE(out.sent.ok());
  EXPECT_TRUE(Drained(*tx_));
  EXPECT_TRUE(Drained(*rx_));
  const std::string text = prometheus::TextSerializer().Serialize(registry_.Collect());
  EXPECT_NE(text.find("reason=\"checksum\""), std::string::npos);
}

// The sender's connection drops in the middle of group 2 (its process dying mid-send, as the
// loopback wire plays it): the receiver fails at once, not at its deadline, and frees every
// buffer it posted for groups 2..G.
TEST_F(StreamedHandoffTest, SenderDisconnectInGroupTwoFreesEveryReceiveBuffer) {
  const model::ModelConfig& c = model_->config();
  Handoff h = Encode(Prompt(700));
  transfer::FaultPlan plan;
  plan.action = transfer::FaultPlan::Action::kDisconnect;
  plan.target = transfer::FaultPlan::Target::kData;
  plan.nth = PiecesBefore(h, 700, 2);
  MakeEngines(plan);
  worker::HandoffHeader header{"r-drop", "fp", 700, 0, false};
  Outcome out;
  const auto start = std::chrono::steady_clock::now();
  std::thread rx([&] {
    out.received = receiver_->ReceiveStreamable(c, header, h.expected, absl::Seconds(60), nullptr,
                                                nullptr, kChunk);
  });
  {
    worker::HandoffStreamSender s(*sender_, c, rx_->LocalAddress(), header, h.expected,
                                  absl::Seconds(60), nullptr, kChunk);
    for (int64_t pos = kChunk; pos <= 3 * kChunk && out.sent.ok(); pos += kChunk) {
      out.sent = s.SendReady(h.segments, pos);
      if (pos <= 2 * kChunk) WaitSenderIdle(*tx_);
    }
    // The "process" dies here: the rest is never offered (the destructor cancels what was).
  }
  rx.join();
  ASSERT_FALSE(out.received.ok());
  EXPECT_NE(std::string(out.received.status().message()).find("streamed group 2 of"),
            std::string::npos)
      << out.received.status();
  // Well before the 60 s deadline: the failure of group 2 ends the whole receive.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(45));
  EXPECT_TRUE(Drained(*rx_));
  EXPECT_TRUE(Drained(*tx_));
}

// The sender vanishes between groups (groups 0-1 confirmed, nothing else ever offered): the
// receiver's posted receives end at their deadline and every buffer is freed.
TEST_F(StreamedHandoffTest, SenderGoneBetweenGroupsFreesEveryReceiveBufferAtTheDeadline) {
  MakeEngines();
  const model::ModelConfig& c = model_->config();
  Handoff h = Encode(Prompt(700));
  worker::HandoffHeader header{"r-gone", "fp", 700, 0, false};
  Outcome out;
  std::thread rx([&] {
    out.received = receiver_->ReceiveStreamable(c, header, h.expected, absl::Seconds(2), nullptr,
                                                nullptr, kChunk);
  });
  {
    worker::HandoffStreamSender s(*sender_, c, rx_->LocalAddress(), header, h.expected,
                                  absl::Seconds(10), nullptr, kChunk);
    for (int64_t pos = kChunk; pos <= 2 * kChunk && out.sent.ok(); pos += kChunk) {
      out.sent = s.SendReady(h.segments, pos);
      WaitSenderIdle(*tx_);
    }
    ASSERT_TRUE(out.sent.ok()) << out.sent;
    ASSERT_EQ(s.sent(), 2);
  }
  tx_.reset();  // the sender's engine is gone with its connection
  rx.join();
  ASSERT_FALSE(out.received.ok());
  EXPECT_NE(std::string(out.received.status().message()).find("streamed group 2 of"),
            std::string::npos)
      << out.received.status();
  EXPECT_TRUE(Drained(*rx_));
}

}  // namespace
}  // namespace epd
