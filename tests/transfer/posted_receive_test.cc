// The UCX data path with pre-posted tagged receives (protocol 2): two engines of this process over
// real UCX (tcp listener and shared memory), the sender's wire wrapped in the fault decorator.
// Each fault must end the transfer on both sides with the accounting error it deserves, release
// every buffer and posted receive, and leave the connection usable for the next hand-off.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <optional>
#include <thread>

#include "transfer/fault_wire.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "transfer/transfer_error.h"
#include "transfer/ucx_wire.h"
#include "prometheus/registry.h"
#include "tests/transfer/transfer_testing.h"

namespace epd::transfer {
namespace {

using ::testing::HasSubstr;

class PostedReceiveTest : public ::testing::TestWithParam<std::string> {
 protected:
  UcxOptions Ucx() const {
    UcxOptions uo;
    uo.mode = GetParam() == "tcp" ? UcxOptions::Mode::kListener : UcxOptions::Mode::kWorkerAddress;
    uo.net_devices = "lo";
    return uo;
  }

  void Make(FaultPlan plan) {
    EngineOptions o;
    o.config_fingerprint = "fp";
    o.cluster_token = "tok";
    o.chunk_bytes = 256 << 10;
    o.release_grace = absl::Milliseconds(200);
    EngineOptions ro = o;
    ro.eager_receive_bytes = eager_receive_bytes_;
    auto rx = TransferEngine::Create(MakeUcxWire(Ucx()), ro, registry_, clock_);
    ASSERT_TRUE(rx.ok()) << rx.status();
    rx_ = std::move(*rx);
    auto tx = TransferEngine::Create(MakeFaultWire(MakeUcxWire(Ucx()), plan), o, registry_, clock_);
    ASSERT_TRUE(tx.ok()) << tx.status();
    tx_ = std::move(*tx);
    auto peer = tx_->Connect(rx_->LocalAddress(), absl::Seconds(10));
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  // 8 segments of 1 MiB: 32 chunks of 256 KiB, so faults on chunk 5 land mid-transfer.
  epd::v1::Manifest Bulk(const std::string& rid) {
    return testing::BulkManifest(rid, "fp", 8, 1 << 20);
  }

  TransferId StartReceive(const epd::v1::Manifest& m, TransferOptions opts = {}) {
    auto buf = rx_->Allocate(TotalBytes(m));
    EXPECT_TRUE(buf.ok());
    auto id = rx_->Receive(m, std::move(*buf), opts);
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  TransferId StartSend(const epd::v1::Manifest& m, uint64_t seed, TransferOptions opts = {}) {
    auto buf = tx_->Allocate(TotalBytes(m));
    EXPECT_TRUE(buf.ok());
    testing::FillPayload(m, (*buf)->data(), seed);
    auto id = tx_->Send(peer_, m, std::move(*buf), opts);
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  void ExpectAllReleased() {
    for (KvTransport* t :
         {static_cast<KvTransport*>(tx_.get()), static_cast<KvTransport*>(rx_.get())}) {
      ResourceCounts c;
      for (int i = 0; i < 600; ++i) {
        c = t->Resources();
        if (c.registrations == 0 && c.allocations == 0 && c.live_transfers == 0 && c.wire_ops == 0)
          break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_EQ(c.registrations, 0);
      EXPECT_EQ(c.allocations, 0);
      EXPECT_EQ(c.live_transfers, 0);
      EXPECT_EQ(c.wire_ops, 0);
    }
  }

  // After a fault, the same connection still carries a hand-off bit-identical.
  void ExpectConnectionStillWorks(const std::string& rid) {
    const auto m = Bulk(rid);
    const TransferId rid_id = StartReceive(m);
    const TransferId sid = StartSend(m, 7);
    ASSERT_TRUE(rx_->Wait(rid_id, absl::Seconds(30)).ok());
    ASSERT_TRUE(tx_->Wait(sid, absl::Seconds(30)).ok());
    auto got = rx_->TakeReceived(rid_id);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 7), "");
    for (const auto& s : got->manifest.segments()) EXPECT_NE(s.checksum(), 0u);
    got->buffer.reset();
    rx_->Forget(rid_id);
    tx_->Forget(sid);
  }

  // Runs one faulty hand-off; returns the receiver's and the sender's outcome.
  std::pair<absl::Status, absl::Status> RunFaulty(const std::string& rid, bool cancel = false) {
    const auto m = Bulk(rid);
    TransferOptions opts;
    opts.deadline = absl::Seconds(2);
    const TransferId r = StartReceive(m, opts);
    opts.deadline = absl::Seconds(3);
    const TransferId s = StartSend(m, 3, opts);
    if (cancel) {
      for (int i = 0; i < 1000 && rx_->Status(r)->state == TransferState::kExpecting; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      rx_->Cancel(r, "client went away");
    }
    absl::Status rs = rx_->Wait(r, absl::Seconds(20));
    absl::Status ss = tx_->Wait(s, absl::Seconds(20));
    rx_->Forget(r);
    tx_->Forget(s);
    return {rs, ss};
  }

  FaultPlan Plan(FaultPlan::Action a, int nth) {
    FaultPlan p;
    p.action = a;
    p.target = FaultPlan::Target::kData;
    p.nth = nth;
    p.corrupt_offset = 1000;
    return p;
  }

  uint64_t eager_receive_bytes_ = 0;  // the receiver's EngineOptions (set before Make)
  common::SystemClock& clock_ = common::SystemClock::Get();
  prometheus::Registry registry_;
  std::unique_ptr<TransferEngine> rx_;
  std::unique_ptr<TransferEngine> tx_;
  PeerId peer_ = 0;
};

TEST_P(PostedReceiveTest, HandoffLandsInPostedReceivesBitIdentical) {
  Make({});
  ASSERT_TRUE(rx_->Capabilities().zero_copy_receive);
  ExpectConnectionStillWorks("clean-1");
  ExpectConnectionStillWorks("clean-2");
  ExpectAllReleased();
}

TEST_P(PostedReceiveTest, TruncatedChunkIsAnAccountingError) {
  Make(Plan(FaultPlan::Action::kTruncate, 5));
  auto [rs, ss] = RunFaulty("trunc");
  EXPECT_EQ(rs.code(), absl::StatusCode::kDataLoss) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("truncated"));
  EXPECT_FALSE(ss.ok());
  ExpectAllReleased();
  ExpectConnectionStillWorks("after-trunc");
}

TEST_P(PostedReceiveTest, CorruptedChunkFailsItsChecksum) {
  Make(Plan(FaultPlan::Action::kCorrupt, 5));
  auto [rs, ss] = RunFaulty("corrupt");
  EXPECT_EQ(rs.code(), absl::StatusCode::kDataLoss) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("field checksum"));
  EXPECT_FALSE(ss.ok());
  // The cause travels as a status payload on both sides (callers never parse the message).
  const std::optional<TransferErrorInfo> rinfo = TransferErrorOf(rs);
  ASSERT_TRUE(rinfo.has_value()) << rs;
  EXPECT_EQ(rinfo->reason, "checksum");
  EXPECT_EQ(rinfo->field, "checksum");
  const std::optional<TransferErrorInfo> sinfo = TransferErrorOf(ss);
  ASSERT_TRUE(sinfo.has_value()) << ss;
  EXPECT_EQ(sinfo->reason, "rejected_accounting");
  EXPECT_EQ(sinfo->field, "checksum");
  ExpectAllReleased();
  ExpectConnectionStillWorks("after-corrupt");
}

TEST_P(PostedReceiveTest, DroppedChunkEndsAtTheDeadlineAndItsReceiveIsCancelled) {
  Make(Plan(FaultPlan::Action::kDrop, 5));
  auto [rs, ss] = RunFaulty("drop");
  EXPECT_EQ(rs.code(), absl::StatusCode::kDeadlineExceeded) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("bytes"));
  EXPECT_FALSE(ss.ok());
  ExpectAllReleased();  // the posted receive of the dropped chunk was cancelled
  ExpectConnectionStillWorks("after-drop");
}

TEST_P(PostedReceiveTest, ReceiverCancelMidTransferEndsBothSides) {
  FaultPlan slow = Plan(FaultPlan::Action::kDelay, -1);
  slow.delay = absl::Milliseconds(20);
  slow.spaced = true;
  Make(slow);
  auto [rs, ss] = RunFaulty("cancel", /*cancel=*/true);
  EXPECT_EQ(rs.code(), absl::StatusCode::kCancelled) << rs;
  EXPECT_FALSE(ss.ok());
  EXPECT_THAT(ss.message(), HasSubstr("client went away"));
  ExpectAllReleased();
}

// The chunks follow the offer before any claim: sent before the Receive exists, they wait in UCX
// (unexpected) and land once the manifest check posts their receives.
TEST_P(PostedReceiveTest, ChunksSentBeforeTheReceiveExistsLandOnceItIsPosted) {
  Make({});
  const auto m = Bulk("early");
  const TransferId s = StartSend(m, 11);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const TransferId r = StartReceive(m);
  ASSERT_TRUE(rx_->Wait(r, absl::Seconds(30)).ok());
  ASSERT_TRUE(tx_->Wait(s, absl::Seconds(30)).ok());
  auto got = rx_->TakeReceived(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 11), "");
  got->buffer.reset();
  rx_->Forget(r);
  tx_->Forget(s);
  ExpectAllReleased();
}

// A refused offer's early chunks are discarded by the receiver's wire: the sender's sends
// complete, nothing lands in the receiver's buffer, and the connection carries on.
TEST_P(PostedReceiveTest, RefusedOfferHasItsEarlyChunksDiscarded) {
  Make({});
  const auto offered = Bulk("refused");
  auto expected = testing::BulkManifest("refused", "fp", 8, (1 << 20) + 64);
  const TransferId r = StartReceive(expected);
  const TransferId s = StartSend(offered, 5);
  absl::Status rs = rx_->Wait(r, absl::Seconds(20));
  absl::Status ss = tx_->Wait(s, absl::Seconds(20));
  EXPECT_EQ(rs.code(), absl::StatusCode::kFailedPrecondition) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("byte_length"));
  EXPECT_EQ(ss.code(), absl::StatusCode::kFailedPrecondition) << ss;
  rx_->Forget(r);
  tx_->Forget(s);
  ExpectAllReleased();
  ExpectConnectionStillWorks("after-refused");
}

// Nobody claims: the sender's lease expires, the receiver drops the held offer and discards its
// chunks; both sides release everything.
TEST_P(PostedReceiveTest, UnclaimedOfferReleasesItsEarlyChunksAtLeaseExpiry) {
  Make({});
  const auto m = Bulk("unclaimed");
  TransferOptions opts;
  opts.lease = absl::Milliseconds(300);
  const TransferId s = StartSend(m, 5, opts);
  absl::Status ss = tx_->Wait(s, absl::Seconds(20));
  EXPECT_EQ(ss.code(), absl::StatusCode::kDeadlineExceeded) << ss;
  EXPECT_THAT(ss.message(), HasSubstr("lease expired"));
  tx_->Forget(s);
  ExpectAllReleased();
  ExpectConnectionStillWorks("after-unclaimed");
}

// EngineOptions::eager_receive_bytes: an offer with no Receive yet is received at once (the
// sender completes before any Receive exists); the ReceiveAny that comes later takes it over and
// gets the verified bytes; one over the receive's limit is refused; one nobody takes is freed when
// the sender's lease ends.
TEST_P(PostedReceiveTest, EagerReceiveCompletesBeforeItsReceiveWhichThenTakesItOver) {
  eager_receive_bytes_ = 16 << 20;
  Make({});
  const auto m = Bulk("eager");  // 8 MiB
  const TransferId s = StartSend(m, 13);
  ASSERT_TRUE(tx_->Wait(s, absl::Seconds(30)).ok());  // received and verified: no Receive yet
  tx_->Forget(s);
  auto r = rx_->ReceiveAny(testing::BulkManifest("eager", "fp", 8, 0), 8 << 20, {});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(rx_->Wait(*r, absl::Seconds(1)).ok());
  auto got = rx_->TakeReceived(*r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->buffer->size(), 8u << 20);
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 13), "");
  got->buffer.reset();

  const TransferId s2 = StartSend(Bulk("eager-big"), 14);
  ASSERT_TRUE(tx_->Wait(s2, absl::Seconds(30)).ok());
  tx_->Forget(s2);
  auto small = rx_->ReceiveAny(testing::BulkManifest("eager-big", "fp", 8, 0), 1 << 20, {});
  ASSERT_TRUE(small.ok()) << small.status();
  absl::Status rs = rx_->Wait(*small, absl::Seconds(1));
  EXPECT_EQ(rs.code(), absl::StatusCode::kFailedPrecondition) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("over the receive's limit"));
  rx_->Forget(*small);

  TransferOptions short_lease;
  short_lease.lease = absl::Milliseconds(300);
  const TransferId s3 = StartSend(Bulk("eager-nobody"), 15, short_lease);
  ASSERT_TRUE(tx_->Wait(s3, absl::Seconds(30)).ok());
  tx_->Forget(s3);
  ExpectAllReleased();  // the unclaimed one goes at its lease's end
  ExpectConnectionStillWorks("after-eager");
}

INSTANTIATE_TEST_SUITE_P(Transports, PostedReceiveTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace epd::transfer
