// The transfer engine over the in-process loopback wire: session state machine, handshake,
// accounting, leases and every fault of the decorator. Fast and deterministic (FakeClock for
// leases and deadlines).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <mutex>

#include <cstring>
#include <span>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "transfer/fault_wire.h"
#include "tests/testing/loopback_wire.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "prometheus/registry.h"
#include "tests/transfer/transfer_testing.h"
#include "tests/testing/handoff_layout.h"

namespace epd::transfer {
namespace {

using testing::FillPayload;
using ::testing::HasSubstr;
using testing::NanoRequest;

double MetricSum(prometheus::Registry& registry, const std::string& name,
                 const std::string& label = "", const std::string& value = "") {
  double sum = 0;
  for (const auto& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric) {
      bool match = label.empty();
      for (const auto& l : metric.label)
        if (l.name == label && l.value == value) match = true;
      if (match) sum += metric.counter.value;
    }
  }
  return sum;
}

class EngineTest : public ::testing::Test {
 protected:
  // Waits (bounded) until the receiver has claimed the sender's offer: a fault injected after this
  // lands mid-transfer however loaded the machine is (a fixed sleep does not).
  void AwaitClaimed(TransferId rid) {
    for (int i = 0; i < 1000; ++i) {
      auto st = rx_->Status(rid);
      ASSERT_TRUE(st.ok()) << st.status();
      if (st->state != TransferState::kExpecting) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(rx_->Status(rid)->state, TransferState::kTransferring);
  }

  void Make(FaultPlan plan = {}, std::string rx_fp = "fp", std::string rx_token = "tok",
            uint64_t chunk = 64 << 10) {
    net_ = MakeLoopbackNetwork();
    EngineOptions o;
    o.config_fingerprint = "fp";
    o.cluster_token = "tok";
    o.chunk_bytes = chunk;
    o.pool_bytes = pool_bytes_;
    o.inline_hash_bytes = inline_hash_bytes_;
    auto tx = TransferEngine::Create(MakeFaultWire(MakeLoopbackWire(net_, "tx"), plan), o,
                                     registry_, clock_);
    ASSERT_TRUE(tx.ok()) << tx.status();
    tx_ = std::move(*tx);
    o.config_fingerprint = rx_fp;
    o.cluster_token = rx_token;
    auto rx = TransferEngine::Create(MakeLoopbackWire(net_, "rx"), o, registry_, clock_);
    ASSERT_TRUE(rx.ok()) << rx.status();
    rx_ = std::move(*rx);
  }

  PeerId ConnectOk() {
    auto peer = tx_->Connect(rx_->LocalAddress(), absl::Seconds(5));
    EXPECT_TRUE(peer.ok()) << peer.status();
    return peer.ok() ? *peer : 0;
  }

  epd::v1::Manifest Nano(const std::string& rid) {
    return *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                  NanoRequest(rid, "fp"));
  }

  TransferId StartReceive(const epd::v1::Manifest& expected, TransferOptions opts = {}) {
    auto buf = rx_->Allocate(TotalBytes(expected));
    EXPECT_TRUE(buf.ok());
    auto id = rx_->Receive(expected, std::move(*buf), opts);
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  TransferId StartSend(PeerId peer, const epd::v1::Manifest& m, TransferOptions opts = {}) {
    auto buf = tx_->Allocate(TotalBytes(m));
    EXPECT_TRUE(buf.ok());
    FillPayload(m, (*buf)->data(), 42);
    auto id = tx_->Send(peer, m, std::move(*buf), opts);
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  // Advances the fake clock in steps until `id` is terminal on `t` (the engine ticks every 5 ms).
  absl::Status WaitAdvancing(KvTransport& t, TransferId id, int64_t max_ms) {
    for (int64_t ms = 0; ms <= max_ms; ms += 50) {
      absl::Status st = t.Wait(id, absl::Milliseconds(20));
      if (!absl::IsDeadlineExceeded(st) || st.message().find("Wait:") == std::string::npos)
        return st;
      clock_.AdvanceMs(50);
    }
    return t.Wait(id, absl::Seconds(1));
  }

  void ExpectAllReleased() {
    for (KvTransport* t :
         {static_cast<KvTransport*>(tx_.get()), static_cast<KvTransport*>(rx_.get())}) {
      ResourceCounts c;
      for (int i = 0; i < 400; ++i) {
        c = t->Resources();
        if (c.registrations == 0 && c.allocations == 0 && c.live_transfers == 0 && c.wire_ops == 0)
          break;
        clock_.AdvanceMs(10);  // lets the release grace period pass
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      EXPECT_EQ(c.registrations, 0);
      EXPECT_EQ(c.allocations, 0);
      EXPECT_EQ(c.allocated_bytes, 0);
      EXPECT_EQ(c.live_transfers, 0);
      EXPECT_EQ(c.wire_ops, 0);
    }
  }

  uint64_t pool_bytes_ = 0;         // EngineOptions::pool_bytes of both engines (set before Make)
  uint64_t inline_hash_bytes_ = 0;  // EngineOptions::inline_hash_bytes of both (before Make)
  common::FakeClock clock_;
  prometheus::Registry registry_;
  std::shared_ptr<LoopbackNetwork> net_;
  std::unique_ptr<TransferEngine> tx_;
  std::unique_ptr<TransferEngine> rx_;
};

TEST_F(EngineTest, NanoHandoffArrivesBitIdentical) {
  Make();
  const PeerId peer = ConnectOk();
  const auto m = Nano("req-1");
  const TransferId rid = StartReceive(m);
  const TransferId sid = StartSend(peer, m);
  ASSERT_TRUE(rx_->Wait(rid, absl::Seconds(10)).ok());
  ASSERT_TRUE(tx_->Wait(sid, absl::Seconds(10)).ok());
  auto got = rx_->TakeReceived(rid);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "");
  for (const auto& s : got->manifest.segments()) EXPECT_NE(s.checksum(), 0u);
  got->buffer.reset();
  tx_->Forget(sid);
  ExpectAllReleased();
  EXPECT_EQ(MetricSum(registry_, "epd_transfer_bytes_total", "direction", "recv"),
            static_cast<double>(TotalBytes(m)));
}

TEST_F(EngineTest, OfferBeforeReceiveIsHeldUntilClaimed) {
  Make();
  const PeerId peer = ConnectOk();
  const auto m = Nano("early");
  const TransferId sid = StartSend(peer, m);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(tx_->Status(sid)->state, TransferState::kOffered);
  const TransferId rid = StartReceive(m);
  ASSERT_TRUE(rx_->Wait(rid, absl::Seconds(10)).ok());
  ASSERT_TRUE(tx_->Wait(sid, absl::Seconds(10)).ok());
  rx_->Forget(rid);
  tx_->Forget(sid);
  ExpectAllReleased();
}

// Detach (the kvstore client after the daemon confirmed a bulk put): the live transfer is not
// failed, runs to its end, counts no failure, and its record and buffers are dropped then. Forget
// on a live transfer, by contrast, fails it.
TEST_F(EngineTest, DetachedTransferRunsToItsEndWithoutAFailure) {
  Make();
  const PeerId peer = ConnectOk();
  const auto m = Nano("detached");
  const TransferId sid = StartSend(peer, m);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_EQ(tx_->Status(sid)->state, TransferState::kOffered);
  tx_->Detach(sid);
  EXPECT_EQ(tx_->Status(sid)->state, TransferState::kOffered);
  const TransferId rid = StartReceive(m);
  ASSERT_TRUE(rx_->Wait(rid, absl::Seconds(10)).ok());
  auto got = rx_->TakeReceived(rid);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "");
  got->buffer.reset();
  ExpectAllReleased();
  EXPECT_EQ(MetricSum(registry_, "epd_transfer_failures_total"), 0.0);
  for (int i = 0; i < 200 && tx_->Status(sid).ok(); ++i) {
    clock_.AdvanceMs(10);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_FALSE(tx_->Status(sid).ok()) << "the detached record was never dropped";

  const TransferId sid2 = StartSend(peer, Nano("forgotten"));
  tx_->Forget(sid2);
  EXPECT_EQ(MetricSum(registry_, "epd_transfer_failures_total"), 1.0);
}

TEST_F(EngineTest, HandshakeRefusesOtherFingerprint) {
  Make({}, "other-fp");
  auto peer = tx_->Connect(rx_->LocalAddress(), absl::Seconds(5));
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(peer.status().message(), HasSubstr("config_fingerprint differs"));
  EXPECT_EQ(
      MetricSum(registry_, "epd_transfer_handshake_refused_total", "reason", "config_fingerprint"),
      1);
}

// Every control message either side sends, appended to `log` (the wire is the loopback one).
class RecordingWire final : public Wire {
 public:
  RecordingWire(std::unique_ptr<Wire> inner, std::string* log, std::mutex* mu)
      : inner_(std::move(inner)), log_(log), mu_(mu) {}
  absl::Status Start(WireHandler* handler) override { return inner_->Start(handler); }
  void Stop() override { inner_->Stop(); }
  TransportCapabilities Capabilities() const override { return inner_->Capabilities(); }
  std::string LocalAddress() const override { return inner_->LocalAddress(); }
  absl::StatusOr<PeerId> Connect(absl::string_view a, absl::Duration t) override {
    return inner_->Connect(a, t);
  }
  TransportKind PeerKind(PeerId peer) const override { return inner_->PeerKind(peer); }
  void SendControl(PeerId peer, std::string bytes, Done done) override {
    {
      std::lock_guard<std::mutex> lock(*mu_);
      log_->append(bytes);
    }
    inner_->SendControl(peer, std::move(bytes), std::move(done));
  }
  void SendData(PeerId peer, const DataHeader& h, const uint8_t* data, uint64_t n, uint64_t mem,
                Done done) override {
    inner_->SendData(peer, h, data, n, mem, std::move(done));
  }
  void ClosePeer(PeerId peer, absl::Status why, bool dead) override {
    inner_->ClosePeer(peer, std::move(why), dead);
  }
  absl::StatusOr<uint64_t> Register(void* addr, uint64_t length) override {
    return inner_->Register(addr, length);
  }
  void Deregister(uint64_t handle) override { inner_->Deregister(handle); }

 private:
  std::unique_ptr<Wire> inner_;
  std::string* log_;
  std::mutex* mu_;
};

// The mutual handshake (docs/security.md): both sides prove the secret and neither sends it, with
// the same secret (accepted) and with different ones (refused).
TEST_F(EngineTest, TheHandshakeNeverSendsTheSecret) {
  const std::string secret = "a-secret-that-must-never-be-on-the-wire-0123";
  for (const std::string& rx_secret : {secret, std::string("another-cluster-secret-4567890")}) {
    auto net = MakeLoopbackNetwork();
    std::string log;
    std::mutex mu;
    EngineOptions o;
    o.config_fingerprint = "fp";
    o.cluster_token = secret;
    auto tx = TransferEngine::Create(
        std::make_unique<RecordingWire>(MakeLoopbackWire(net, "tx"), &log, &mu), o, registry_,
        clock_);
    ASSERT_TRUE(tx.ok()) << tx.status();
    o.cluster_token = rx_secret;
    auto rx = TransferEngine::Create(
        std::make_unique<RecordingWire>(MakeLoopbackWire(net, "rx"), &log, &mu), o, registry_,
        clock_);
    ASSERT_TRUE(rx.ok()) << rx.status();
    auto peer = (*tx)->Connect((*rx)->LocalAddress(), absl::Seconds(5));
    EXPECT_EQ(peer.ok(), rx_secret == secret) << peer.status();
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_FALSE(log.empty());
    EXPECT_EQ(log.find(secret), std::string::npos);
    EXPECT_EQ(log.find(rx_secret), std::string::npos);
  }
}

TEST_F(EngineTest, HandshakeRefusesOtherClusterTokenWithoutLoggingIt) {
  Make({}, "fp", "secret-b");
  auto peer = tx_->Connect(rx_->LocalAddress(), absl::Seconds(5));
  ASSERT_FALSE(peer.ok());
  EXPECT_THAT(peer.status().message(), HasSubstr("could not prove the cluster secret"));
  EXPECT_THAT(peer.status().message(), ::testing::Not(HasSubstr("secret-b")));
}

TEST_F(EngineTest, ManifestMismatchFailsBothSidesNamingTheField) {
  Make();
  const PeerId peer = ConnectOk();
  const auto expected = Nano("mm");
  epd::testing::HandoffLayout four = epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode);
  four.dspark_block_size = 4;
  const auto offered = *epd::testing::BuildExpectedManifest(four, NanoRequest("mm", "fp"));
  const TransferId rid = StartReceive(expected);
  const TransferId sid = StartSend(peer, offered);
  absl::Status rs = rx_->Wait(rid, absl::Seconds(5));
  absl::Status ss = tx_->Wait(sid, absl::Seconds(5));
  EXPECT_EQ(rs.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(rs.message(), HasSubstr("dspark_noise"));
  EXPECT_THAT(rs.message(), HasSubstr("pos_end"));
  EXPECT_EQ(ss.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ss.message(), HasSubstr("dspark_noise"));
  EXPECT_EQ(MetricSum(registry_, "epd_transfer_accounting_errors_total", "segment", "dspark_noise"),
            1);
  EXPECT_EQ(tx_->Status(sid)->bytes_done, 0u);  // not a byte was sent
  rx_->Forget(rid);
  tx_->Forget(sid);
  ExpectAllReleased();
}

TEST_F(EngineTest, LeaseExpiresWhenNobodyClaims) {
  Make();
  const PeerId peer = ConnectOk();
  TransferOptions opts;
  opts.lease = absl::Seconds(2);
  const TransferId sid = StartSend(peer, Nano("unclaimed"), opts);
  absl::Status st = WaitAdvancing(*tx_, sid, 5000);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(st.message(), HasSubstr("lease expired"));
  tx_->Forget(sid);
  ExpectAllReleased();
}

// The receiver gives up before the sender's offer arrives: the late offer is refused at once with
// the receiver's reason (it is not parked until its lease runs out).
TEST_F(EngineTest, AnOfferAfterTheReceiverCancelledIsRefusedAtOnce) {
  Make(FaultPlan{});
  const PeerId peer = ConnectOk();
  const auto m = Nano("late");
  const TransferId rid = StartReceive(m);
  rx_->Cancel(rid, "client went away");
  EXPECT_EQ(rx_->Wait(rid, absl::Seconds(5)).code(), absl::StatusCode::kCancelled);
  const TransferId sid = StartSend(peer, m);
  absl::Status ss = tx_->Wait(sid, absl::Seconds(5));
  EXPECT_FALSE(ss.ok());
  EXPECT_THAT(ss.message(), HasSubstr("client went away"));
  rx_->Forget(rid);
  tx_->Forget(sid);
  ExpectAllReleased();
}

TEST_F(EngineTest, ReceiverCancelEndsSenderToo) {
  // Data is held back long enough that the cancel always lands mid-transfer (after the claim),
  // however loaded the machine is.
  Make(FaultPlan{FaultPlan::Action::kDelay, FaultPlan::Target::kData, -1, absl::Milliseconds(500)});
  const PeerId peer = ConnectOk();
  const auto m = Nano("cancel");
  const TransferId rid = StartReceive(m);
  const TransferId sid = StartSend(peer, m);
  AwaitClaimed(rid);
  rx_->Cancel(rid, "client went away");
  EXPECT_EQ(rx_->Wait(rid, absl::Seconds(5)).code(), absl::StatusCode::kCancelled);
  absl::Status ss = tx_->Wait(sid, absl::Seconds(5));
  EXPECT_FALSE(ss.ok());
  EXPECT_THAT(ss.message(), HasSubstr("client went away"));
  rx_->Forget(rid);
  tx_->Forget(sid);
  ExpectAllReleased();
}

struct FaultCase {
  std::string name;
  FaultPlan plan;
  absl::StatusCode receiver_code;
  std::string receiver_says;
};

class FaultTest : public EngineTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(FaultTest, EndsCleanlyOnBothSidesWithinDeadline) {
  const FaultCase& c = GetParam();
  Make(c.plan);
  const PeerId peer = ConnectOk();
  const auto m = Nano("fault-" + c.name);
  TransferOptions opts;
  opts.deadline = absl::Seconds(3);
  opts.lease = absl::Seconds(2);
  const TransferId rid = StartReceive(m, opts);
  opts.deadline = absl::Seconds(4);  // the receiver's deadline fires first
  const TransferId sid = StartSend(peer, m, opts);
  absl::Status rs = WaitAdvancing(*rx_, rid, 4000);
  absl::Status ss = WaitAdvancing(*tx_, sid, 4000);
  EXPECT_EQ(rs.code(), c.receiver_code) << rs;
  EXPECT_THAT(rs.message(), HasSubstr(c.receiver_says));
  EXPECT_FALSE(ss.ok());
  rx_->Forget(rid);
  tx_->Forget(sid);
  ExpectAllReleased();
}

FaultPlan Plan(FaultPlan::Action a, FaultPlan::Target t, int nth, absl::Duration d = {}) {
  FaultPlan p;
  p.action = a;
  p.target = t;
  p.nth = nth;
  p.delay = d;
  p.corrupt_offset = 100;
  return p;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FaultTest,
    ::testing::Values(
        FaultCase{"drop_data", Plan(FaultPlan::Action::kDrop, FaultPlan::Target::kData, 3),
                  absl::StatusCode::kDeadlineExceeded, "has 0 of"},
        // Control message 0 is the hello, 1 the handshake proof, 2 the offer: a dropped offer is
        // never claimed.
        FaultCase{"drop_offer", Plan(FaultPlan::Action::kDrop, FaultPlan::Target::kControl, 2),
                  absl::StatusCode::kDeadlineExceeded, "while expecting"},
        FaultCase{"delay_past_deadline",
                  Plan(FaultPlan::Action::kDelay, FaultPlan::Target::kData, 0, absl::Seconds(600)),
                  absl::StatusCode::kDeadlineExceeded, "exceeded its deadline"},
        FaultCase{"truncate", Plan(FaultPlan::Action::kTruncate, FaultPlan::Target::kData, 5),
                  absl::StatusCode::kDataLoss, "truncated"},
        FaultCase{"corrupt", Plan(FaultPlan::Action::kCorrupt, FaultPlan::Target::kData, 7),
                  absl::StatusCode::kDataLoss, "field checksum"},
        FaultCase{"disconnect", Plan(FaultPlan::Action::kDisconnect, FaultPlan::Target::kData, 2),
                  absl::StatusCode::kUnavailable, "disconnected"}),
    [](const auto& info) { return info.param.name; });

TEST_F(EngineTest, DelayWithinDeadlineStillSucceeds) {
  Make(Plan(FaultPlan::Action::kDelay, FaultPlan::Target::kData, -1, absl::Milliseconds(2)));
  const PeerId peer = ConnectOk();
  const auto m = Nano("slow");
  const TransferId rid = StartReceive(m);
  const TransferId sid = StartSend(peer, m);
  ASSERT_TRUE(rx_->Wait(rid, absl::Seconds(20)).ok());
  ASSERT_TRUE(tx_->Wait(sid, absl::Seconds(20)).ok());
  auto got = rx_->TakeReceived(rid);
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "");
}

TEST_F(EngineTest, SenderWireDeathFailsReceiverAndReleasesEverything) {
  Make(Plan(FaultPlan::Action::kDelay, FaultPlan::Target::kData, -1, absl::Milliseconds(300)));
  const PeerId peer = ConnectOk();
  const auto m = Nano("death");
  const TransferId rid = StartReceive(m);
  StartSend(peer, m);
  AwaitClaimed(rid);
  tx_.reset();  // the whole sender goes away mid-transfer
  absl::Status rs = rx_->Wait(rid, absl::Seconds(5));
  EXPECT_TRUE(rs.code() == absl::StatusCode::kUnavailable ||
              rs.code() == absl::StatusCode::kAborted)
      << rs;
  rx_->Forget(rid);
  ResourceCounts c = rx_->Resources();
  for (int i = 0; i < 200 && c.live_transfers != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    c = rx_->Resources();
  }
  EXPECT_EQ(c.registrations, 0);
  EXPECT_EQ(c.allocations, 0);
  EXPECT_EQ(c.live_transfers, 0);
}

TEST_F(EngineTest, SizeMismatchIsRefusedLocally) {
  Make();
  const PeerId peer = ConnectOk();
  auto m = Nano("size");
  auto buf = tx_->Allocate(TotalBytes(m) - 1);
  auto id = tx_->Send(peer, m, std::move(*buf), {});
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  ExpectAllReleased();
}

// ReceiveAny: posted before the length is known; the offer's length is taken (within the limit),
// every other manifest field, every chunk and the checksums are checked as for Receive.
TEST_F(EngineTest, ReceiveAnyTakesTheOfferedLengthWithinItsLimit) {
  Make();
  const PeerId peer = ConnectOk();
  const auto m = testing::BulkManifest("any", "fp", 3, 100'000);
  auto r = rx_->ReceiveAny(testing::BulkManifest("any", "fp", 3, 0), 1 << 20, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(rx_->Resources().allocations, 0);  // no buffer until the offer says how large
  const TransferId s = StartSend(peer, m);
  ASSERT_TRUE(rx_->Wait(*r, absl::Seconds(10)).ok());
  ASSERT_TRUE(tx_->Wait(s, absl::Seconds(10)).ok());
  auto got = rx_->TakeReceived(*r);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->buffer->size(), 300'000u);
  EXPECT_EQ(got->manifest.segments(1).byte_length(), 100'000u);
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "");
  got->buffer.reset();
  tx_->Forget(s);

  // Over the limit: refused as an accounting error on both sides, nothing allocated.
  auto small = rx_->ReceiveAny(testing::BulkManifest("big", "fp", 3, 0), 200'000, {});
  ASSERT_TRUE(small.ok()) << small.status();
  const TransferId s2 = StartSend(peer, testing::BulkManifest("big", "fp", 3, 100'000));
  absl::Status rs = rx_->Wait(*small, absl::Seconds(10));
  EXPECT_EQ(rs.code(), absl::StatusCode::kFailedPrecondition) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("over the receive's limit of 200000"));
  EXPECT_EQ(tx_->Wait(s2, absl::Seconds(10)).code(), absl::StatusCode::kFailedPrecondition);

  // Another fingerprint: the usual manifest check names the field.
  auto other = rx_->ReceiveAny(testing::BulkManifest("fpx", "other", 1, 0), 1 << 20, {});
  ASSERT_TRUE(other.ok()) << other.status();
  const TransferId s3 = StartSend(peer, testing::BulkManifest("fpx", "fp", 1, 1000));
  rs = rx_->Wait(*other, absl::Seconds(10));
  EXPECT_EQ(rs.code(), absl::StatusCode::kFailedPrecondition) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("config_fingerprint"));
  EXPECT_FALSE(tx_->Wait(s3, absl::Seconds(10)).ok());
  for (TransferId id : {*small, *other}) rx_->Forget(id);
  for (TransferId id : {s2, s3}) tx_->Forget(id);
  EXPECT_FALSE(rx_->ReceiveAny(testing::BulkManifest("zero", "fp", 1, 0), 0, {}).ok());
  ExpectAllReleased();
}

// A receive withdrawn before any offer is an unused reservation: no failure counted, and an offer
// arriving later is refused at once (not held until its lease expires).
TEST_F(EngineTest, WithdrawnReceiveEndsQuietlyAndALateOfferIsRefused) {
  Make();
  const PeerId peer = ConnectOk();
  auto r = rx_->ReceiveAny(testing::BulkManifest("gone", "fp", 1, 0), 1 << 20, {});
  ASSERT_TRUE(r.ok()) << r.status();
  const double failures = MetricSum(registry_, "epd_transfer_failures_total");
  rx_->Withdraw(*r);
  EXPECT_EQ(MetricSum(registry_, "epd_transfer_failures_total"), failures);
  auto st = rx_->Status(*r);  // ended (or already collected)
  EXPECT_TRUE(!st.ok() || st->state == TransferState::kFailed);
  const TransferId s = StartSend(peer, testing::BulkManifest("gone", "fp", 1, 5000));
  absl::Status ss = tx_->Wait(s, absl::Seconds(10));  // no clock advance: refused, not expired
  EXPECT_FALSE(ss.ok());
  EXPECT_THAT(ss.message(), HasSubstr("withdrawn"));
  tx_->Forget(s);

  // Withdrawing a receive whose offer was accepted cancels it like Cancel (the sender learns).
  auto r2 = rx_->ReceiveAny(testing::BulkManifest("mid", "fp", 1, 0), 1 << 20, {});
  ASSERT_TRUE(r2.ok()) << r2.status();
  const TransferId s2 = StartSend(peer, testing::BulkManifest("mid", "fp", 1, 5000));
  ASSERT_TRUE(tx_->Wait(s2, absl::Seconds(10)).ok());  // the loopback finishes it at once
  rx_->Withdraw(*r2);                                  // done already: just collected
  tx_->Forget(s2);
  ExpectAllReleased();
}

// checksums_in_manifest: the sender's precomputed checksums travel in the offer (no seal); the
// receiver still hashes what arrived and refuses a mismatch.
TEST_F(EngineTest, ChecksumsInTheManifestAreCheckedByTheReceiver) {
  Make();
  const PeerId peer = ConnectOk();
  auto send = [&](const std::string& rid, int64_t delta) {
    auto m = testing::BulkManifest(rid, "fp", 1, 70'000);
    auto buf = tx_->Allocate(70'000);
    EXPECT_TRUE(buf.ok());
    FillPayload(m, (*buf)->data(), 42);
    m.mutable_segments(0)->set_checksum_kind(epd::v1::CHECKSUM_XXH3_64);
    m.mutable_segments(0)->set_checksum(
        common::Xxh3_64(std::span<const uint8_t>((*buf)->data(), 70'000)) + delta);
    TransferOptions o;
    o.checksums_in_manifest = true;
    return tx_->Send(peer, m, std::move(*buf), o);
  };
  const TransferId r = StartReceive(testing::BulkManifest("pre", "fp", 1, 70'000));
  auto s = send("pre", 0);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(rx_->Wait(r, absl::Seconds(10)).ok());
  ASSERT_TRUE(tx_->Wait(*s, absl::Seconds(10)).ok());
  rx_->Forget(r);
  tx_->Forget(*s);

  const TransferId bad_r = StartReceive(testing::BulkManifest("lie", "fp", 1, 70'000));
  auto bad = send("lie", 1);
  ASSERT_TRUE(bad.ok()) << bad.status();
  absl::Status rs = rx_->Wait(bad_r, absl::Seconds(10));
  EXPECT_EQ(rs.code(), absl::StatusCode::kDataLoss) << rs;
  EXPECT_THAT(rs.message(), HasSubstr("field checksum"));
  EXPECT_FALSE(tx_->Wait(*bad, absl::Seconds(10)).ok());
  rx_->Forget(bad_r);
  tx_->Forget(*bad);

  // Without a checksum kind the send is refused before anything moves.
  auto m = testing::BulkManifest("nokind", "fp", 1, 10);
  m.mutable_segments(0)->set_checksum_kind(epd::v1::CHECKSUM_UNSPECIFIED);
  auto buf = tx_->Allocate(10);
  TransferOptions o;
  o.checksums_in_manifest = true;
  EXPECT_EQ(tx_->Send(peer, m, std::move(*buf), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectAllReleased();
}

// EngineOptions::pool_bytes: a freed buffer is kept (registered) and handed out again; idle
// buffers are not counted as outstanding, and buffers still held at shutdown stay valid.
TEST_F(EngineTest, PooledBuffersAreReusedAndNeverCountedAsOutstanding) {
  pool_bytes_ = 4 << 20;
  Make();
  const PeerId peer = ConnectOk();
  auto a = tx_->Allocate(1 << 20);
  ASSERT_TRUE(a.ok());
  uint8_t* first = (*a)->data();
  a->reset();
  EXPECT_EQ(tx_->Resources().pooled_bytes, 1 << 20);
  EXPECT_EQ(tx_->Resources().allocations, 0);
  auto b = tx_->Allocate((1 << 20) - 5);  // same size class: the same memory again
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->data(), first);
  EXPECT_EQ(tx_->Resources().pooled_bytes, 0);
  b->reset();
  for (int round = 0; round < 3; ++round) {  // transfers over pooled buffers on both sides
    const std::string rid = absl::StrCat("pooled-", round);
    const auto m = testing::BulkManifest(rid, "fp", 2, 300'000);
    const TransferId r = StartReceive(m);
    const TransferId s = StartSend(peer, m);
    ASSERT_TRUE(rx_->Wait(r, absl::Seconds(10)).ok());
    ASSERT_TRUE(tx_->Wait(s, absl::Seconds(10)).ok());
    auto got = rx_->TakeReceived(r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "");
    got->buffer.reset();
    tx_->Forget(s);
    // Every buffer back in its pool before the next round (the sender's is released after a
    // grace period), so each side reuses its one slab: registrations 0, the pool's are its own,
    // made once.
    ExpectAllReleased();
  }
  EXPECT_EQ(rx_->Resources().pooled_bytes, 1 << 20);
  // Below pool_min_bytes: plain memory, never pooled.
  auto tiny = tx_->Allocate(100);
  ASSERT_TRUE(tiny.ok());
  tiny->reset();
  EXPECT_EQ(tx_->Resources().pooled_bytes, 1 << 20);
  // A buffer held across the engine's end stays usable and is freed by its holder.
  auto held = rx_->Allocate(1 << 20);
  ASSERT_TRUE(held.ok());
  rx_.reset();
  std::memset((*held)->data(), 7, 1 << 20);
  held->reset();
}

// The pool's limit counts idle buffers; a buffer returned when the idle ones would exceed it
// pushes out the least recently returned ones, so a run of hand-offs of a new size is pooled even
// while buffers of an earlier size sit idle (before, every buffer of the new size was freed and
// the next one allocated and registered afresh: 256 MiB hand-offs after 16 MiB ones in
// transfer_bench, at 0.4 GiB/s over tcp).
TEST_F(EngineTest, APooledBufferOfANewSizePushesOutTheOldestIdleOnes) {
  pool_bytes_ = 4 << 20;
  Make();
  auto small1 = tx_->Allocate(1 << 20), small2 = tx_->Allocate(1 << 20);
  ASSERT_TRUE(small1.ok() && small2.ok());
  small1->reset();
  small2->reset();
  EXPECT_EQ(tx_->Resources().pooled_bytes, 2 << 20);
  EXPECT_EQ(tx_->Resources().pooled_buffers, 2);
  auto big = tx_->Allocate(4 << 20);  // the whole limit
  ASSERT_TRUE(big.ok());
  uint8_t* big_data = (*big)->data();
  big->reset();  // kept: both idle 1 MiB buffers go
  EXPECT_EQ(tx_->Resources().pooled_bytes, 4 << 20);
  EXPECT_EQ(tx_->Resources().pooled_buffers, 1);
  auto again = tx_->Allocate(4 << 20);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->data(), big_data);  // reused, not allocated afresh
  // Over the limit: never pooled.
  auto huge = tx_->Allocate(8 << 20);
  ASSERT_TRUE(huge.ok());
  huge->reset();
  EXPECT_EQ(tx_->Resources().pooled_bytes, 0);
  again->reset();
  // Oldest first: with 2 + 1 MiB idle, returning another 2 MiB evicts the older 2 MiB buffer.
  auto a = tx_->Allocate(2 << 20), b = tx_->Allocate(1 << 20), c = tx_->Allocate(2 << 20);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  uint8_t* c_data = (*c)->data();
  a->reset();  // evicts the idle 4 MiB buffer
  b->reset();
  c->reset();  // 2 + 1 + 2 > 4: `a`'s buffer goes
  EXPECT_EQ(tx_->Resources().pooled_bytes, 3 << 20);
  auto d = tx_->Allocate(2 << 20);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)->data(), c_data);
  EXPECT_EQ(tx_->Resources().pooled_bytes, 1 << 20);
}

// EngineOptions::inline_hash_bytes: a small transfer is hashed by the sender in Send() (checksums
// in the offer, no seal) and by the receiver's wire thread as each chunk lands; every byte and
// checksum is still checked: a flipped byte fails both sides with the checksum named, and a
// transfer over the limit takes the hashing thread and the seal as before.
TEST_F(EngineTest, SmallTransfersHashInlineAndStillCatchACorruptedByte) {
  inline_hash_bytes_ = 1 << 20;
  Make();
  const PeerId peer = ConnectOk();
  for (int round = 0; round < 3; ++round) {
    for (uint64_t seg : {uint64_t{1000}, uint64_t{300'000}, uint64_t{700'000}}) {  // 2 segments
      const std::string rid = absl::StrCat("inline-", round, "-", seg);
      const auto m = testing::BulkManifest(rid, "fp", 2, seg);
      const TransferId r = StartReceive(m);
      const TransferId s = StartSend(peer, m);
      ASSERT_TRUE(rx_->Wait(r, absl::Seconds(10)).ok()) << rid;
      ASSERT_TRUE(tx_->Wait(s, absl::Seconds(10)).ok()) << rid;
      auto got = rx_->TakeReceived(r);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "") << rid;
      got->buffer.reset();
      tx_->Forget(s);
    }
  }
  ExpectAllReleased();

  // The third data chunk (64 KiB chunks: inside segment 0 of 300,000 B) arrives with a byte
  // flipped.
  FaultPlan p;
  p.action = FaultPlan::Action::kCorrupt;
  p.target = FaultPlan::Target::kData;
  p.nth = 2;
  p.corrupt_offset = 100;
  Make(p);
  const PeerId peer2 = ConnectOk();
  const auto m = testing::BulkManifest("inline-corrupt", "fp", 2, 300'000);
  const TransferId r = StartReceive(m);
  const TransferId s = StartSend(peer2, m);
  const absl::Status rs = rx_->Wait(r, absl::Seconds(10));
  EXPECT_TRUE(absl::IsDataLoss(rs)) << rs;
  EXPECT_NE(rs.message().find("checksum"), std::string::npos) << rs;
  EXPECT_FALSE(tx_->Wait(s, absl::Seconds(10)).ok());
  rx_->Forget(r);
  tx_->Forget(s);
  ExpectAllReleased();
}

}  // namespace
}  // namespace epd::transfer
