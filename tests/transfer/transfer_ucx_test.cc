// Real UCX between this process and transfer_peer processes on 127.0.0.1: bit-identical hand-offs
// over TCP (listener) and shared memory (worker-address exchange), SIGKILL of either side in the
// middle of a transfer, handshake and accounting errors across processes, and a run across two
// network namespaces joined by a veth pair.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "transfer/fault_wire.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_wire.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "tests/transfer/transfer_testing.h"
#include "tests/testing/subprocess.h"
#include "tests/testing/handoff_layout.h"

namespace epd::transfer {
namespace {

using epd::testing::BinaryPath;
using epd::testing::Subprocess;
using epd::testing::TempDir;
using ::testing::AnyOf;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string WaitForFile(const std::string& path, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    std::string s = ReadFile(path);
    if (!s.empty()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "";
}

class UcxTest : public ::testing::TestWithParam<std::string> {
 protected:
  bool Shm() const { return GetParam() == "shm"; }

  std::unique_ptr<TransferEngine> MakeTransport(FaultPlan plan = {}, std::string token = "tok") {
    UcxOptions uo;
    uo.mode = Shm() ? UcxOptions::Mode::kWorkerAddress : UcxOptions::Mode::kListener;
    uo.net_devices = "lo";
    EngineOptions eo;
    eo.config_fingerprint = "fp";
    eo.cluster_token = token;
    eo.node_name = "test";
    eo.chunk_bytes = 64 << 10;
    auto e = TransferEngine::Create(MakeFaultWire(MakeUcxWire(uo), plan), eo, registry_,
                                    common::SystemClock::Get());
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  Subprocess StartPeer(std::vector<std::string> args, const std::string& log) {
    std::vector<std::string> argv = {BinaryPath("transfer_peer"), "--mode", GetParam()};
    argv.insert(argv.end(), args.begin(), args.end());
    return Subprocess::Start(argv, dir_.File(log), {{"UCX_NET_DEVICES", "lo"}});
  }

  static void ExpectReleased(KvTransport& t) {
    ResourceCounts c;
    for (int i = 0; i < 500; ++i) {
      c = t.Resources();
      if (!c.registrations && !c.allocations && !c.live_transfers && !c.wire_ops) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(c.registrations, 0);
    EXPECT_EQ(c.allocations, 0);
    EXPECT_EQ(c.live_transfers, 0);
    EXPECT_EQ(c.wire_ops, 0);
  }

  TempDir dir_;
  prometheus::Registry registry_;
};

// The peer sends a nano-shaped decode hand-off; this process receives it into its own buffer.
TEST_P(UcxTest, NanoDecodeHandoffIsBitIdentical) {
  auto rx = MakeTransport();
  const auto m = *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                        testing::NanoRequest("nano-1", "fp", 1000));
  auto id = rx->Receive(m, *rx->Allocate(TotalBytes(m)), {});
  ASSERT_TRUE(id.ok());
  Subprocess peer = StartPeer({"--role", "send", "--connect", rx->LocalAddress(), "--request-id",
                               "nano-1", "--result-file", dir_.File("send.json")},
                              "send.log");
  ASSERT_TRUE(rx->Wait(*id, absl::Seconds(20)).ok()) << rx->Status(*id)->error;
  EXPECT_EQ(rx->Status(*id)->transport, Shm() ? TransportKind::kShm : TransportKind::kTcp);
  auto got = rx->TakeReceived(*id);
  ASSERT_TRUE(got.ok());
  // Checksums (verified by the engine) and a byte-for-byte comparison.
  EXPECT_EQ(testing::ComparePayload(m, got->buffer->data(), 42), "");
  ASSERT_EQ(got->manifest.segments_size(), m.segments_size());
  EXPECT_EQ(peer.Wait(std::chrono::seconds(20)), 0) << peer.ReadLog();
  got->buffer.reset();
  ExpectReleased(*rx);
}

// This process sends 256 MiB in 16 segments; the peer receives, checks checksums and bytes.
TEST_P(UcxTest, Bulk256MiBIsBitIdenticalAtThePeer) {
  auto tx = MakeTransport();
  Subprocess peer = StartPeer(
      {"--role", "recv", "--workload", "bulk", "--bulk-mib", "256", "--request-id", "bulk-1",
       "--address-file", dir_.File("addr"), "--result-file", dir_.File("recv.json")},
      "recv.log");
  const std::string addr = WaitForFile(dir_.File("addr"), std::chrono::seconds(20));
  ASSERT_FALSE(addr.empty()) << peer.ReadLog();
  auto p = tx->Connect(addr, absl::Seconds(10));
  ASSERT_TRUE(p.ok()) << p.status();
  const auto m = testing::BulkManifest("bulk-1", "fp", 16, (256ull << 20) / 16);
  auto buf = tx->Allocate(TotalBytes(m));
  testing::FillPayload(m, (*buf)->data(), 42);
  auto id = tx->Send(*p, m, std::move(*buf), {});
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(tx->Wait(*id, absl::Seconds(60)).ok()) << tx->Status(*id)->error;
  EXPECT_EQ(peer.Wait(std::chrono::seconds(30)), 0) << peer.ReadLog();
  auto result = nlohmann::json::parse(ReadFile(dir_.File("recv.json")));
  EXPECT_TRUE(result["ok"].get<bool>()) << result.dump();
  EXPECT_EQ(result["byte_compare"], "identical");
  EXPECT_EQ(result["bytes"].get<uint64_t>(), 256ull << 20);
  EXPECT_EQ(result["transport"], GetParam());
  EXPECT_EQ(result["registrations"], 0);
  EXPECT_EQ(result["allocations"], 0);
  tx->Forget(*id);
  ExpectReleased(*tx);
}

TEST_P(UcxTest, SigkillOfTheSenderFailsTheReceiverCleanly) {
  auto rx = MakeTransport();
  const auto m = *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                        testing::NanoRequest("kill-s", "fp", 1000));
  TransferOptions opts;
  opts.deadline = absl::Seconds(8);
  auto id = rx->Receive(m, *rx->Allocate(TotalBytes(m)), opts);
  ASSERT_TRUE(id.ok());
  // ~27 chunks of 64 KiB, 60 ms apart: the transfer takes about 1.6 s.
  Subprocess peer = StartPeer({"--role", "send", "--connect", rx->LocalAddress(), "--request-id",
                               "kill-s", "--chunk-kib", "64", "--delay-data-ms", "60"},
                              "send.log");
  const auto start = std::chrono::steady_clock::now();
  while (rx->Status(*id)->bytes_done == 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GT(rx->Status(*id)->bytes_done, 0u) << peer.ReadLog();
  ASSERT_LT(rx->Status(*id)->bytes_done, TotalBytes(m));
  const auto killed_at = std::chrono::steady_clock::now();
  peer.Signal(SIGKILL);
  absl::Status st = rx->Wait(*id, absl::Seconds(10));
  const auto took = std::chrono::steady_clock::now() - killed_at;
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(took, std::chrono::seconds(8));  // within the deadline (pid check / endpoint error)
  rx->Forget(*id);
  ExpectReleased(*rx);
}

TEST_P(UcxTest, SigkillOfTheReceiverFailsTheSenderCleanly) {
  FaultPlan slow;
  slow.action = FaultPlan::Action::kDelay;
  slow.nth = -1;
  slow.delay = absl::Milliseconds(60);
  slow.spaced = true;
  auto tx = MakeTransport(slow);
  Subprocess peer =
      StartPeer({"--role", "recv", "--request-id", "kill-r", "--address-file", dir_.File("addr")},
                "recv.log");
  const std::string addr = WaitForFile(dir_.File("addr"), std::chrono::seconds(20));
  ASSERT_FALSE(addr.empty()) << peer.ReadLog();
  auto p = tx->Connect(addr, absl::Seconds(10));
  ASSERT_TRUE(p.ok()) << p.status();
  const auto m = *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                        testing::NanoRequest("kill-r", "fp", 1000));
  auto buf = tx->Allocate(TotalBytes(m));
  testing::FillPayload(m, (*buf)->data(), 42);
  TransferOptions opts;
  opts.deadline = absl::Seconds(8);
  auto id = tx->Send(*p, m, std::move(*buf), opts);
  ASSERT_TRUE(id.ok());
  const auto start = std::chrono::steady_clock::now();
  while (tx->Status(*id)->bytes_done == 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GT(tx->Status(*id)->bytes_done, 0u);
  ASSERT_EQ(tx->Status(*id)->state, TransferState::kTransferring);
  const auto killed_at = std::chrono::steady_clock::now();
  peer.Signal(SIGKILL);
  absl::Status st = tx->Wait(*id, absl::Seconds(10));
  const auto took = std::chrono::steady_clock::now() - killed_at;
  EXPECT_FALSE(st.ok());
  EXPECT_LT(took, std::chrono::seconds(8));
  tx->Forget(*id);
  // The next hand-off to the dead peer is refused at once as UNAVAILABLE (the router re-dispatches
  // on that code), and it holds nothing.
  auto again = tx->Send(*p, m, std::move(*tx->Allocate(TotalBytes(m))), opts);
  if (again.ok()) {
    absl::Status st2 = tx->Wait(*again, absl::Seconds(10));
    EXPECT_EQ(st2.code(), absl::StatusCode::kUnavailable) << st2;
    tx->Forget(*again);
  } else {
    EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  }
  ExpectReleased(*tx);
}

TEST_P(UcxTest, ClusterTokenMismatchIsRefusedAtConnect) {
  Subprocess peer = StartPeer({"--role", "recv", "--token", "other", "--deadline-ms", "3000",
                               "--address-file", dir_.File("addr")},
                              "recv.log");
  const std::string addr = WaitForFile(dir_.File("addr"), std::chrono::seconds(20));
  ASSERT_FALSE(addr.empty());
  auto tx = MakeTransport();
  auto p = tx->Connect(addr, absl::Seconds(10));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
  // The peer's proof does not verify with our secret: refused before we prove anything.
  EXPECT_THAT(p.status().message(), HasSubstr("could not prove the cluster secret"));
  peer.Signal(SIGKILL);
}

TEST_P(UcxTest, SenderWithFourNoiseSlotsIsCaughtByTheReceiver) {
  auto rx = MakeTransport();
  const auto m = *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                        testing::NanoRequest("noise", "fp", 1000));
  auto id = rx->Receive(m, *rx->Allocate(TotalBytes(m)), {});
  ASSERT_TRUE(id.ok());
  Subprocess peer =
      StartPeer({"--role", "send", "--connect", rx->LocalAddress(), "--request-id", "noise",
                 "--noise-slots", "4", "--result-file", dir_.File("send.json")},
                "send.log");
  absl::Status st = rx->Wait(*id, absl::Seconds(20));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("dspark_noise"));
  EXPECT_EQ(peer.Wait(std::chrono::seconds(20)), 1);
  auto result = nlohmann::json::parse(ReadFile(dir_.File("send.json")));
  EXPECT_THAT(result["error"].get<std::string>(), HasSubstr("dspark_noise"));
  rx->Forget(*id);
  ExpectReleased(*rx);
}

// A peer whose UCX endpoints are configured differently (no peer error handling against a
// listener that uses it) is refused by UCX at accept time; the listener must stay up and serve
// the next, well-configured peer (UCX consumes a refused connection request itself).
TEST_P(UcxTest, AMisconfiguredPeerCannotTakeDownTheListener) {
  if (Shm()) GTEST_SKIP() << "the listener (TCP) mode only";
  auto rx = MakeTransport();
  {
    UcxOptions uo;
    uo.mode = UcxOptions::Mode::kListener;
    uo.net_devices = "lo";
    uo.peer_error_handling = false;
    EngineOptions eo;
    eo.config_fingerprint = "fp";
    eo.cluster_token = "tok";
    eo.node_name = "misconfigured";
    prometheus::Registry other;
    auto bad = TransferEngine::Create(MakeUcxWire(uo), eo, other, common::SystemClock::Get());
    ASSERT_TRUE(bad.ok()) << bad.status();
    auto p = (*bad)->Connect(rx->LocalAddress(), absl::Seconds(3));
    EXPECT_FALSE(p.ok());
  }
  const auto m = *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                        testing::NanoRequest("after", "fp", 1000));
  auto id = rx->Receive(m, *rx->Allocate(TotalBytes(m)), {});
  ASSERT_TRUE(id.ok());
  Subprocess peer = StartPeer(
      {"--role", "send", "--connect", rx->LocalAddress(), "--request-id", "after"}, "send.log");
  EXPECT_TRUE(rx->Wait(*id, absl::Seconds(20)).ok());
  rx->Forget(*id);
  EXPECT_EQ(peer.Wait(std::chrono::seconds(20)), 0);
}

double Metric(prometheus::Registry& registry, const std::string& name, const std::string& label,
              const std::string& value) {
  double sum = 0;
  for (const auto& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric)
      for (const auto& l : metric.label)
        if (l.name == label && l.value == value) sum += metric.counter.value + metric.gauge.value;
  }
  return sum;
}

TEST_P(UcxTest, BytesAreCountedPerTransportAndSegmentKind) {
  auto rx = MakeTransport();
  const auto m = *epd::testing::BuildExpectedManifest(epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode),
                                        testing::NanoRequest("metrics", "fp", 1000));
  auto id = rx->Receive(m, *rx->Allocate(TotalBytes(m)), {});
  ASSERT_TRUE(id.ok());
  Subprocess peer = StartPeer(
      {"--role", "send", "--connect", rx->LocalAddress(), "--request-id", "metrics"}, "send.log");
  ASSERT_TRUE(rx->Wait(*id, absl::Seconds(20)).ok());
  EXPECT_EQ(Metric(registry_, "epd_transfer_bytes_total", "transport", GetParam()),
            static_cast<double>(TotalBytes(m)));
  EXPECT_EQ(Metric(registry_, "epd_transfer_bytes_total", "segment", "swa_kv"), 12.0 * 128 * 528);
  rx->Forget(*id);
  EXPECT_EQ(peer.Wait(std::chrono::seconds(20)), 0);
}

// The startup self-test names the transport UCX picked and publishes the bandwidth.
TEST_P(UcxTest, StartupSelfTestReportsTheTransport) {
  UcxOptions uo;
  uo.mode = Shm() ? UcxOptions::Mode::kWorkerAddress : UcxOptions::Mode::kListener;
  uo.net_devices = "lo";
  auto r = RunBandwidthSelfTest(uo, 8 << 20, registry_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->transport, Shm() ? TransportKind::kShm : TransportKind::kTcp);
  EXPECT_GT(r->bytes_per_second, 0);
  EXPECT_GT(Metric(registry_, "epd_transfer_selftest_bandwidth_bytes_per_second", "transport",
                   GetParam()),
            0);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

// Both sides in their own network namespace, joined by a veth pair: the bytes cross a real
// network stack (TCP over veth), not loopback.
class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for ip netns (not root here)";
    for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"})
      if (access(p, X_OK) == 0) {
        ip_ = p;
        break;
      }
    if (ip_.empty()) GTEST_SKIP() << "no ip(8) binary (iproute2) found";
    const std::string id = std::to_string(getpid() % 100000);
    ns_a_ = "epdxa" + id;
    ns_b_ = "epdxb" + id;
    veth_a_ = "epxa" + id;
    veth_b_ = "epxb" + id;
    subnet_ = "10.213." + std::to_string(getpid() % 250) + ".";
    std::string out;
    if (epd::testing::RunCommand("ip netns add " + ns_a_ + " 2>&1", &out) != 0)
      GTEST_SKIP() << "ip netns add is not permitted here: " << out;
    created_ = true;
    const std::vector<std::string> cmds = {
        "ip netns add " + ns_b_,
        "ip link add " + veth_a_ + " type veth peer name " + veth_b_,
        "ip link set " + veth_a_ + " netns " + ns_a_,
        "ip link set " + veth_b_ + " netns " + ns_b_,
        "ip -n " + ns_a_ + " addr add " + subnet_ + "1/24 dev " + veth_a_,
        "ip -n " + ns_b_ + " addr add " + subnet_ + "2/24 dev " + veth_b_,
        "ip -n " + ns_a_ + " link set " + veth_a_ + " up",
        "ip -n " + ns_b_ + " link set " + veth_b_ + " up",
        "ip -n " + ns_a_ + " link set lo up",
        "ip -n " + ns_b_ + " link set lo up"};
    for (const auto& c : cmds) {
      if (epd::testing::RunCommand(c + " 2>&1", &out) != 0)
        GTEST_SKIP() << "network namespace setup failed at '" << c << "': " << out;
    }
  }
  void TearDown() override {
    if (!created_) return;
    // Deleting the namespaces removes the veth pair with them.
    epd::testing::RunCommand("ip netns del " + ns_a_ + " 2>/dev/null");
    epd::testing::RunCommand("ip netns del " + ns_b_ + " 2>/dev/null");
  }

  std::string ip_, ns_a_, ns_b_, veth_a_, veth_b_, subnet_;
  bool created_ = false;
  TempDir dir_;
};

TEST_F(NetnsTest, HandoffCrossesAVethPairBitIdentical) {
  const std::string peer_bin = BinaryPath("transfer_peer");
  Subprocess recv = Subprocess::Start({ip_,
                                       "netns",
                                       "exec",
                                       ns_a_,
                                       peer_bin,
                                       "--role",
                                       "recv",
                                       "--mode",
                                       "tcp",
                                       "--tls",
                                       "tcp",
                                       "--ip",
                                       subnet_ + "1",
                                       "--net-devices",
                                       veth_a_,
                                       "--workload",
                                       "bulk",
                                       "--bulk-mib",
                                       "64",
                                       "--request-id",
                                       "netns",
                                       "--address-file",
                                       dir_.File("addr"),
                                       "--result-file",
                                       dir_.File("recv.json")},
                                      dir_.File("recv.log"));
  const std::string addr = WaitForFile(dir_.File("addr"), std::chrono::seconds(20));
  ASSERT_FALSE(addr.empty()) << recv.ReadLog();
  EXPECT_THAT(addr, HasSubstr(subnet_ + "1"));
  Subprocess send = Subprocess::Start({ip_,
                                       "netns",
                                       "exec",
                                       ns_b_,
                                       peer_bin,
                                       "--role",
                                       "send",
                                       "--mode",
                                       "tcp",
                                       "--tls",
                                       "tcp",
                                       "--net-devices",
                                       veth_b_,
                                       "--workload",
                                       "bulk",
                                       "--bulk-mib",
                                       "64",
                                       "--request-id",
                                       "netns",
                                       "--connect",
                                       addr,
                                       "--result-file",
                                       dir_.File("send.json")},
                                      dir_.File("send.log"));
  EXPECT_EQ(send.Wait(std::chrono::seconds(60)), 0) << send.ReadLog();
  EXPECT_EQ(recv.Wait(std::chrono::seconds(60)), 0) << recv.ReadLog();
  auto result = nlohmann::json::parse(ReadFile(dir_.File("recv.json")));
  EXPECT_EQ(result["byte_compare"], "identical") << result.dump();
  EXPECT_EQ(result["transport"], "tcp");
  EXPECT_EQ(result["registrations"], 0);
  // The bytes went through the veth pair: its counters moved by at least the payload.
  std::string rx_bytes;
  epd::testing::RunCommand(
      "ip netns exec " + ns_a_ + " cat /sys/class/net/" + veth_a_ + "/statistics/rx_bytes",
      &rx_bytes);
  EXPECT_GE(std::stoull(rx_bytes), 64ull << 20);
}

}  // namespace
}  // namespace epd::transfer
