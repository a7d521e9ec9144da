// The three stages chained in one process (no sockets): encoder -> prefill -> decode equals the
// monolithic Model::Prefill + Decode (greedy), and every hand-off has exactly the shape the
// receiver derives on its own (runtime/worker/handoff.h).
#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <thread>

#include "common/clock.h"
#include "decode_pool/decode_stage.h"
#include "encoder_pool/encoder_stage.h"
#include "kernels/backend.h"
#include "tests/testing/loopback_wire.h"
#include "transfer/transfer_engine.h"
#include "model/model.h"
#include "prefill_pool/prefill_stage.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "runtime/worker/handoff.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

class StageChainTest : public testing::NanoModelTest {
 protected:
  static std::vector<int32_t> Prompt(int n) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 10 + (i * 37) % 200;
    return p;
  }
  static std::vector<int32_t> Monolithic(const std::vector<int32_t>& prompt, int max_tokens) {
    auto st = model_->NewSequence();
    auto r = model_->Prefill(*st, prompt, false);
    EXPECT_TRUE(r.ok());
    std::vector<int32_t> out;
    int32_t tok = model::ArgMax(r->logits);
    while (static_cast<int>(out.size()) < max_tokens &&
           tok != static_cast<int32_t>(model_->config().eos_token_id)) {
      out.push_back(tok);
      if (static_cast<int>(out.size()) == max_tokens) break;
      auto d = model_->Decode(*st, tok);
      EXPECT_TRUE(d.ok());
      tok = model::ArgMax(d->logits);
    }
    return out;
  }
};

std::vector<std::pair<std::string, uint64_t>> Flat(const std::vector<worker::SegmentShape>& s) {
  std::vector<std::pair<std::string, uint64_t>> out;
  for (const auto& x : s) out.emplace_back(x.name, x.bytes);
  return out;
}

TEST_F(StageChainTest, ChainEqualsMonolithicAndShapesMatchExpectations) {
  const model::ModelConfig& c = model_->config();
  const std::vector<int32_t> prompt = Prompt(100);
  const int64_t n = static_cast<int64_t>(prompt.size());
  encoder_pool::EncoderStage enc(*model_, worker::HandoffTailRows(c));
  auto e = enc.Run(prompt);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(Flat(worker::ShapesOf(e->state)), Flat(worker::ExpectedStateShapes(c, n, false)));
  EXPECT_EQ(Flat(worker::ShapesOf(worker::PackEncoderOutput(e->output))),
            Flat(worker::ExpectedEncoderOutputShapes(c, n, worker::HandoffTailRows(c))));
  auto round = worker::UnpackEncoderOutput(c, worker::PackEncoderOutput(e->output));
  ASSERT_TRUE(round.ok()) << round.status();

  prefill_pool::PrefillStage pre(*model_);
  auto p = pre.Run(e->state, *round);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(Flat(worker::ShapesOf(p->state)), Flat(worker::ExpectedStateShapes(c, n, true)));

  decode_pool::DecodeStage dec(*model_);
  model::SamplingParams params;
  params.max_tokens = 12;
  auto seq = dec.Start(p->state, p->logits, params, prompt);
  ASSERT_TRUE(seq.ok()) << seq.status();
  while (!(*seq)->done) {
    decode_pool::DecodeSequence* b[] = {seq->get()};
    ASSERT_TRUE(dec.Step(b).ok());
  }
  EXPECT_EQ((*seq)->output, Monolithic(prompt, 12));
  EXPECT_FALSE((*seq)->output.empty());
}

TEST_F(StageChainTest, BatchedStepEqualsOneByOne) {
  decode_pool::DecodeStage dec(*model_);
  model::SamplingParams params;
  params.max_tokens = 6;
  std::vector<std::unique_ptr<decode_pool::DecodeSequence>> seqs;
  for (int n : {40, 70}) {
    auto s = dec.StartFromPrompt(Prompt(n), params);
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(std::move(*s));
  }
  while (!seqs[0]->done || !seqs[1]->done) {
    decode_pool::DecodeSequence* b[] = {seqs[0].get(), seqs[1].get()};
    ASSERT_TRUE(dec.Step(b).ok());
  }
  EXPECT_EQ(seqs[0]->output, Monolithic(Prompt(40), 6));
  EXPECT_EQ(seqs[1]->output, Monolithic(Prompt(70), 6));
}

TEST_F(StageChainTest, BadInputIsRefusedWithACause) {
  encoder_pool::EncoderStage enc(*model_);
  EXPECT_FALSE(enc.Run({}).ok());
  std::vector<int32_t> bad = {1, 2, static_cast<int32_t>(model_->config().vocab_size)};
  auto r = enc.Run(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("token 2"), std::string::npos) << r.status();
  auto u = worker::UnpackEncoderOutput(model_->config(), {});
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.status().message().find("enc.meta"), std::string::npos);
}

// The encoder's hand-off over a (loopback) transfer engine: the receiver's own expectation
// matches, the bytes arrive intact; a receiver expecting another prompt length refuses the offer
// with a message naming the segment and the field, counted as an accounting error.
TEST_F(StageChainTest, HandoffOverTransferEngineAndManifestMismatch) {
  const model::ModelConfig& c = model_->config();
  prometheus::Registry registry;
  auto net = transfer::MakeLoopbackNetwork();
  transfer::EngineOptions o;
  o.config_fingerprint = "fp";
  o.cluster_token = "tok";
  auto tx = transfer::TransferEngine::Create(transfer::MakeLoopbackWire(net, "tx"), o, registry,
                                             common::SystemClock::Get());
  auto rx = transfer::TransferEngine::Create(transfer::MakeLoopbackWire(net, "rx"), o, registry,
                                             common::SystemClock::Get());
  ASSERT_TRUE(tx.ok() && rx.ok());
  worker::HandoffPeer sender(**tx), receiver(**rx);
  encoder_pool::EncoderStage enc(*model_, worker::HandoffTailRows(c));
  const std::vector<int32_t> prompt = Prompt(60);
  auto e = enc.Run(prompt);
  ASSERT_TRUE(e.ok());
  std::vector<model::StateSegment> segs = e->state;
  for (auto& s : worker::PackEncoderOutput(e->output)) segs.push_back(std::move(s));

  auto send = [&](const std::string& rid, absl::Status* out) {
    worker::HandoffHeader h{rid, "fp", 60, 0, false};
    *out = sender.Send((*rx)->LocalAddress(),
                       worker::BuildHandoffManifest(c, h, worker::ShapesOf(segs)), segs,
                       absl::Seconds(10), nullptr);
  };
  {
    std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, 60, false);
    for (auto& s : worker::ExpectedEncoderOutputShapes(c, 60, worker::HandoffTailRows(c)))
      shapes.push_back(s);
    absl::Status sent;
    std::thread t(send, "r-ok", &sent);
    auto got =
        receiver.Receive(worker::BuildHandoffManifest(c, {"r-ok", "fp", 60, 0, false}, shapes),
                         shapes, absl::Seconds(10), nullptr);
    t.join();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(sent.ok()) << sent;
    ASSERT_EQ(got->size(), segs.size());
    for (size_t i = 0; i < segs.size(); ++i) {
      EXPECT_EQ((*got)[i].name, segs[i].name);
      EXPECT_EQ((*got)[i].bytes, segs[i].bytes) << segs[i].name;
    }
  }
  {
    // Same header, but the receiver derives its shapes for 64 tokens: kv/keys lengths differ.
    std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, 64, false);
    for (auto& s : worker::ExpectedEncoderOutputShapes(c, 60, worker::HandoffTailRows(c)))
      shapes.push_back(s);
    absl::Status sent;
    std::thread t(send, "r-bad", &sent);
    auto got =
        receiver.Receive(worker::BuildHandoffManifest(c, {"r-bad", "fp", 60, 0, false}, shapes),
                         shapes, absl::Seconds(10), nullptr);
    t.join();
    ASSERT_FALSE(got.ok());
    EXPECT_FALSE(sent.ok());
    const std::string msg(got.status().message());
    EXPECT_NE(msg.find("segment"), std::string::npos) << msg;
    EXPECT_NE(msg.find("byte_length"), std::string::npos) << msg;
    const std::string text = prometheus::TextSerializer().Serialize(registry.Collect());
    EXPECT_NE(text.find("epd_transfer_accounting_errors_total{"), std::string::npos);
  }
}

}  // namespace
}  // namespace epd
