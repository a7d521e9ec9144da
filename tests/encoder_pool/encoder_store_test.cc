// The encoder's store path (EncoderStage::Run with PrefixOptions) against a real epd-kvstore
// process: a hit, with a live snapshot or with the rings replayed, is bit-identical to the run
// without a store (also across a kvstore restart, which loses the snapshots); what the store
// lacks or holds wrong shortens the prefix or costs a replay, never the request; a daemon that is
// down degrades to P = 0.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <memory>

#include "encoder_pool/encoder_stage.h"
#include "kernels/backend.h"
#include "kvstore/chain_hash.h"
#include "kvstore/kvstore_client.h"
#include "model/model.h"
#include "model/prefix_state.h"
#include "model/sequence_state.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using encoder_pool::EncoderResult;
using encoder_pool::EncoderStage;
using encoder_pool::PrefixOptions;
using encoder_pool::PrefixReport;

class EncoderStoreTest : public testing::NanoModelTest {
 protected:
  void SetUp() override {
    kv_dir_ = std::make_unique<testing::TempDir>();
    StartKvstore("kv");
  }
  // Starts (or restarts) the daemon on kv_dir_'s RocksDB folder and connects client_ to it.
  void StartKvstore(const std::string& name) {
    kv_ = testing::Subprocess::Start(
        {testing::BinaryPath("epd-kvstore"), "--data-dir", kv_dir_->File("data"), "--grpc-port",
         "0", "--metrics-port", "0", "--port-file", kv_dir_->File(name + ".json"),
         // G3 only: a G1 hot copy would shadow the bad values this test puts over good ones.
         "--g1-capacity-bytes", "0"},
        kv_dir_->File(name + ".log"));
    auto port =
        runtime::WaitForPortFile(kv_dir_->File(name + ".json"), "grpc", std::chrono::seconds(30));
    ASSERT_TRUE(port.has_value()) << kv_.ReadLog();
    client_ = kvstore::KvStoreClient::Create("127.0.0.1:" + std::to_string(*port));
  }

  static std::vector<int32_t> Prompt(int n, int salt = 0) {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = 10 + (i * 41 + salt + i / 3) % 450;
    return p;
  }
  PrefixOptions Options(int64_t hint, kvstore::KvStoreClient* store = nullptr) {
    PrefixOptions o;
    o.store = store != nullptr ? store : client_.get();
    o.fingerprint = "fp-test";
    o.hint = hint;
    return o;
  }
  static void ExpectSame(const EncoderResult& a, const EncoderResult& b) {
    ASSERT_EQ(a.state.size(), b.state.size());
    for (size_t i = 0; i < a.state.size(); ++i)
      EXPECT_TRUE(a.state[i].bytes == b.state[i].bytes) << a.state[i].name;
    EXPECT_EQ(a.output.tail_start, b.output.tail_start);
    EXPECT_TRUE(a.output.tail.h == b.output.tail.h);
    EXPECT_TRUE(a.output.tail.pre == b.output.tail.pre);
  }
  std::string Key(const std::vector<int32_t>& p, int block) {
    auto h = kvstore::ChainHashes(p, 64, "fp-test");
    return std::string(kvstore::AsBytes(h[block]));
  }

  std::unique_ptr<testing::TempDir> kv_dir_;
  testing::Subprocess kv_;
  std::unique_ptr<kvstore::KvStoreClient> client_;
};

TEST_F(EncoderStoreTest, PrefixCapIsTheLastBlockBoundaryBeforeTheTail) {
  EXPECT_EQ(EncoderStage::PrefixCap(100, 133, 64), 0);
  EXPECT_EQ(EncoderStage::PrefixCap(196, 133, 64), 0);
  EXPECT_EQ(EncoderStage::PrefixCap(197, 133, 64), 64);
  EXPECT_EQ(EncoderStage::PrefixCap(512, 133, 64), 320);
}

TEST_F(EncoderStoreTest, HitWithSnapshotIsBitIdenticalAndMissesDegrade) {
  EncoderStage enc(*model_, 133);
  const std::vector<int32_t> p = Prompt(300);
  // Cold: nothing to read, 4 blocks + the snapshot at 256 written.
  PrefixReport r0;
  auto cold = enc.Run(p, Options(256), &r0);
  ASSERT_TRUE(cold.ok()) << cold.status();
  EXPECT_EQ(r0.cached_tokens, 0);
  EXPECT_EQ(r0.blocks_written, 4);
  EXPECT_TRUE(r0.snapshot_written);
  EXPECT_TRUE(r0.errors.empty()) << r0.warning;

  // Turn 2 extends the prompt: P = 256 from the store, state and output as without a store.
  std::vector<int32_t> p2 = p;
  const auto more = Prompt(200, 7);
  p2.insert(p2.end(), more.begin(), more.end());
  auto plain = enc.Run(p2);
  ASSERT_TRUE(plain.ok());
  PrefixReport r1;
  auto hit = enc.Run(p2, Options(256), &r1);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(r1.cached_tokens, 256);
  EXPECT_TRUE(r1.snapshot_hit);
  EXPECT_FALSE(r1.replayed);
  EXPECT_EQ(r1.blocks_written, 3);  // blocks 4..6 of 500 tokens
  ExpectSame(*plain, *hit);

  // A hint past what is stored: the blocks that are there (the chain of p2 now has 7).
  PrefixReport r2;
  auto past = enc.Run(p2, Options(320), &r2);
  ASSERT_TRUE(past.ok());
  EXPECT_EQ(r2.cached_tokens, 320);
  EXPECT_EQ(r2.blocks_written, 0);  // all stored already

  // The snapshot at 320 was never written (p2's was at 448): a replay (from 0: 320 tokens are
  // fewer than split x window), the same state and output.
  EXPECT_FALSE(r2.snapshot_hit);
  EXPECT_TRUE(r2.replayed);
  EXPECT_EQ(r2.replayed_tokens, 320);
  ExpectSame(*plain, *past);

  // A block value overwritten with garbage: P = 0, counted, the output is the plain one, and
  // the pass writes its blocks over the bad ones, so the next request hits again.
  ASSERT_TRUE(client_->Put(kvstore::Tier::kG3, Key(p2, 0), "not a block").ok());
  PrefixReport r3;
  auto bad = enc.Run(p2, Options(256), &r3);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(r3.cached_tokens, 0);
  ASSERT_EQ(r3.errors.size(), 1u);
  EXPECT_EQ(r3.errors[0], "decode");
  EXPECT_NE(r3.warning.find("block 0"), std::string::npos) << r3.warning;
  EXPECT_EQ(r3.blocks_written, 7);
  ExpectSame(*plain, *bad);
  PrefixReport r4;
  auto again = enc.Run(p2, Options(256), &r4);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(r4.cached_tokens, 256);
  EXPECT_TRUE(r4.errors.empty()) << r4.warning;
  ExpectSame(*plain, *again);

  // Block 0's value under block 1's key (its header says block 0): not used, nothing fails.
  auto b0 = client_->Get(kvstore::Tier::kG3, Key(p2, 0));
  ASSERT_TRUE(b0.ok() && b0->found);
  ASSERT_TRUE(client_->Put(kvstore::Tier::kG3, Key(p2, 1), b0->value).ok());
  PrefixReport r5;
  auto moved = enc.Run(p2, Options(256), &r5);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(r5.cached_tokens, 0);
  ASSERT_EQ(r5.errors.size(), 1u);
  EXPECT_NE(r5.warning.find("block 1"), std::string::npos) << r5.warning;
  ExpectSame(*plain, *moved);
}

// The chaos campaign's finding (docs/chaos.md): a kvstore killed between two turns of a
// conversation loses the G2 snapshots (memory) but keeps the G3 blocks (RocksDB), so turn 2
// reuses the blocks and rebuilds the encoder rings by replay. Its state and output must be the
// ones without a store, bit for bit, and so must those of turn 3, which reads the blocks and the
// snapshot that the replayed turn 2 wrote.
TEST_F(EncoderStoreTest, KvstoreRestartBetweenTurnsKeepsOutputsBitIdentical) {
  EncoderStage enc(*model_, 133);
  const std::vector<int32_t> p1 = Prompt(300, 11);
  PrefixReport r1;
  ASSERT_TRUE(enc.Run(p1, Options(0), &r1).ok());
  ASSERT_EQ(r1.blocks_written, 4);
  ASSERT_TRUE(r1.snapshot_written);

  kv_.Signal(SIGKILL);
  ASSERT_TRUE(kv_.Wait(std::chrono::seconds(30)).has_value());
  StartKvstore("kv2");

  std::vector<int32_t> p2 = p1;
  const auto more = Prompt(200, 12);
  p2.insert(p2.end(), more.begin(), more.end());
  auto plain2 = enc.Run(p2);
  ASSERT_TRUE(plain2.ok());
  PrefixReport r2;
  auto hit2 = enc.Run(p2, Options(256), &r2);
  ASSERT_TRUE(hit2.ok()) << hit2.status();
  EXPECT_TRUE(r2.errors.empty()) << r2.warning;
  EXPECT_EQ(r2.cached_tokens, 256);  // the blocks survived in RocksDB
  EXPECT_FALSE(r2.snapshot_hit);     // the snapshot did not
  EXPECT_TRUE(r2.replayed);
  EXPECT_EQ(r2.replayed_tokens, model::PrefixReplayTokens(model_->config(), 256));
  ExpectSame(*plain2, *hit2);
  EXPECT_EQ(r2.blocks_written, 3);  // blocks 4..6, and the snapshot at 448
  EXPECT_TRUE(r2.snapshot_written);

  std::vector<int32_t> p3 = p2;
  const auto more3 = Prompt(200, 13);
  p3.insert(p3.end(), more3.begin(), more3.end());
  auto plain3 = enc.Run(p3);
  ASSERT_TRUE(plain3.ok());
  PrefixReport r3;
  auto hit3 = enc.Run(p3, Options(448), &r3);
  ASSERT_TRUE(hit3.ok()) << hit3.status();
  EXPECT_EQ(r3.cached_tokens, 448);
  EXPECT_TRUE(r3.snapshot_hit);
  ExpectSame(*plain3, *hit3);
}

// A run cut in chunks (the streamed hand-off's passes) cuts each chunk's new blocks after it:
// the same state and output as one pass, and a later hit on those blocks is bit-identical.
TEST_F(EncoderStoreTest, ChunkedRunWritesBlocksThatAHitReusesBitIdentically) {
  EncoderStage enc(*model_, 133);
  const std::vector<int32_t> p = Prompt(700, 3);
  auto plain = enc.Run(p);
  ASSERT_TRUE(plain.ok()) << plain.status();
  encoder_pool::ChunkOptions chunks;
  chunks.chunk_tokens = 128;
  int calls = 0;
  chunks.after_chunk = [&](const model::SequenceState&) {
    ++calls;
    return absl::OkStatus();
  };
  PrefixReport r0;
  auto cold = enc.Run(p, Options(0), &r0, &chunks);
  ASSERT_TRUE(cold.ok()) << cold.status();
  EXPECT_EQ(calls, 6);               // [0,128) .. [512,640), then [640,700)
  EXPECT_EQ(r0.blocks_written, 10);  // blocks 0..9 of 700 tokens, cut chunk by chunk
  EXPECT_TRUE(r0.snapshot_written);
  EXPECT_TRUE(r0.errors.empty()) << r0.warning;
  ExpectSame(*plain, *cold);

  // Turn 2 (one pass) reuses those blocks and the snapshot: bit-identical to no store.
  std::vector<int32_t> p2 = p;
  const auto more = Prompt(150, 9);
  p2.insert(p2.end(), more.begin(), more.end());
  auto plain2 = enc.Run(p2);
  ASSERT_TRUE(plain2.ok());
  PrefixReport r1;
  auto hit = enc.Run(p2, Options(640), &r1);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(r1.cached_tokens, 640);
  EXPECT_TRUE(r1.snapshot_hit);
  EXPECT_TRUE(r1.errors.empty()) << r1.warning;
  ExpectSame(*plain2, *hit);
}

TEST_F(EncoderStoreTest, TailRuleCapsTheHint) {
  EncoderStage enc(*model_, 133);
  const std::vector<int32_t> p = Prompt(256, 3);
  PrefixReport r0;
  ASSERT_TRUE(enc.Run(p, Options(0), &r0).ok());
  EXPECT_EQ(r0.blocks_written, 4);
  // Same 256 tokens + 60: cap = (316 - 133) / 64 * 64 = 128.
  std::vector<int32_t> p2 = p;
  const auto more = Prompt(60, 9);
  p2.insert(p2.end(), more.begin(), more.end());
  PrefixReport r1;
  auto res = enc.Run(p2, Options(256), &r1);
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(r1.cached_tokens, 128);
  EXPECT_EQ(r1.blocks_written, 0);  // blocks 2, 3 are stored, 4 is not whole
  EXPECT_EQ(res->output.tail.rows, 133);
}

TEST_F(EncoderStoreTest, DaemonDownDegradesToNoPrefix) {
  EncoderStage enc(*model_, 133);
  const std::vector<int32_t> p = Prompt(260, 5);
  auto plain = enc.Run(p);
  ASSERT_TRUE(plain.ok());
  kvstore::KvClientOptions o;
  o.deadline_ms = 500;
  auto dead =
      kvstore::KvStoreClient::Create("127.0.0.1:" + std::to_string(testing::PickFreePort()), o);
  PrefixReport r;
  auto res = enc.Run(p, Options(64, dead.get()), &r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(r.cached_tokens, 0);
  ASSERT_FALSE(r.errors.empty());
  EXPECT_EQ(r.errors[0], "get");
  EXPECT_FALSE(r.warning.empty());
  ExpectSame(*plain, *res);
}

}  // namespace
}  // namespace epd
