// A stranger on the network (no cluster secret) against a real cluster: router + kvstore + one
// worker per pool, each its own process (docs/security.md). Every internal plane refuses it:
// the worker registry (Register under a live worker's id, Heartbeat), worker control (Submit,
// Cancel), the kvstore (Put, Pin, Get, BatchPut, Hello) and the kvstore's UCX handshake (a wrong
// secret, and a proof captured from one handshake replayed in another). The secret never crosses
// the wire, and the cluster still serves afterwards with its own workers.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/cluster_secret.h"
#include "epd/v1/kvstore.grpc.pb.h"
#include "epd/v1/transfer.pb.h"
#include "epd/v1/worker.grpc.pb.h"
#include "runtime/grpc_auth.h"
#include "tests/e2e/real_cluster.h"
#include "tests/testing/nano_model.h"
#include "tests/testing/subprocess.h"
#include "transfer/ucx_wire.h"
#include "transfer/wire.h"

namespace epd {
namespace {

using testing::Generate;
using testing::Prompt;

const std::string kStranger = "the-strangers-own-secret-0123456789";

std::string Secret() { return common::ClusterSecretFromEnv(); }

// A channel that proves `secret` (the stranger's), or none at all (empty).
std::shared_ptr<grpc::Channel> Channel(int port, const std::string& secret) {
  const std::string target = "127.0.0.1:" + std::to_string(port);
  return secret.empty() ? grpc::CreateChannel(target, grpc::InsecureChannelCredentials())
                        : runtime::CreateClusterChannel(target, secret);
}

void ExpectRefused(const grpc::Status& s, const std::string& what) {
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << what << ": " << s.error_message();
  EXPECT_EQ(s.error_message().find(Secret()), std::string::npos) << what;
}

// Plays the transfer handshake by hand over a raw UCX wire: what the stranger sends and receives.
class RawPeer final : public transfer::WireHandler {
 public:
  RawPeer() {
    transfer::UcxOptions uo;
    uo.net_devices = "lo";
    wire_ = transfer::MakeUcxWire(uo);
  }
  ~RawPeer() override { wire_->Stop(); }
  absl::Status Start() { return wire_->Start(this); }
  absl::StatusOr<transfer::PeerId> Connect(const std::string& address) {
    return wire_->Connect(address, absl::Seconds(10));
  }
  void Send(transfer::PeerId peer, const v1::TransferControl& msg) {
    wire_->SendControl(peer, msg.SerializeAsString(), [](absl::Status) {});
  }
  // The next control message, or one with no body after 10 s.
  v1::TransferControl Next() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return !inbox_.empty(); });
    v1::TransferControl msg;
    if (inbox_.empty()) return msg;
    EXPECT_TRUE(msg.ParseFromString(inbox_.front()));
    inbox_.pop_front();
    return msg;
  }
  std::string all_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  void Close(transfer::PeerId peer) { wire_->ClosePeer(peer, absl::CancelledError("done")); }

  void OnControl(transfer::PeerId, std::string bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    received_ += bytes;
    inbox_.push_back(std::move(bytes));
    cv_.notify_all();
  }
  transfer::DataSink OnDataBegin(transfer::PeerId, const transfer::DataHeader&,
                                 uint64_t) override {
    return {};
  }
  void OnDataEnd(transfer::PeerId, const transfer::DataHeader&, uint64_t,
                 absl::Status) override {}
  void OnPeerDown(transfer::PeerId, absl::Status) override {}

 private:
  std::unique_ptr<transfer::Wire> wire_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> inbox_;
  std::string received_;
};

std::string Transcript(const std::string& role, const std::string& nc, const std::string& ns,
                       const std::string& fp) {
  return absl::StrCat("epd-transfer-v3\n", role, "\n", nc, ns, fp);
}

class OutsiderE2ETest : public testing::NanoModelDirTest {};

TEST_F(OutsiderE2ETest, EveryInternalPlaneRefusesAStrangerAndTheSecretNeverCrossesTheWire) {
  testing::RealCluster c({.model_dir = testing::NanoModelDirTest::model_dir(), .store = true});
  ASSERT_GT(c.grpc_port(), 0);
  const int decode_port = c.worker("decode").grpc;
  ASSERT_GT(decode_port, 0);
  const int kv_port = c.kv_grpc();
  ASSERT_GT(kv_port, 0);
  ASSERT_GE(Secret().size(), 16u);

  for (const std::string& secret : {kStranger, std::string()}) {
    const std::string who = secret.empty() ? "no metadata" : "wrong secret";
    // The worker registry: a decode worker under the live one's id would get users' prompts.
    auto registry = v1::WorkerRegistry::NewStub(Channel(c.grpc_port(), secret));
    {
      grpc::ClientContext ctx;
      v1::RegisterRequest req;
      req.set_pool(v1::POOL_DECODE);
      req.set_worker_id("decode-0");
      req.set_control_address("127.0.0.1:1");
      v1::RegisterResponse resp;
      ExpectRefused(registry->Register(&ctx, req, &resp), "Register, " + who);
    }
    {
      grpc::ClientContext ctx;
      v1::HeartbeatRequest req;
      req.set_worker_id("decode-0");
      req.set_draining(true);
      v1::HeartbeatResponse resp;
      ExpectRefused(registry->Heartbeat(&ctx, req, &resp), "Heartbeat, " + who);
    }
    // Worker control: work only the router may give.
    auto control = v1::WorkerControl::NewStub(Channel(decode_port, secret));
    {
      grpc::ClientContext ctx;
      v1::Job job;
      job.set_request_id("stranger-job");
      auto reader = control->Submit(&ctx, job);
      v1::SubmitResponse r;
      EXPECT_FALSE(reader->Read(&r)) << "Submit answered a stranger, " << who;
      ExpectRefused(reader->Finish(), "Submit, " + who);
    }
    {
      grpc::ClientContext ctx;
      v1::CancelRequest req;
      req.set_request_id("anything");
      v1::CancelResponse resp;
      ExpectRefused(control->Cancel(&ctx, req, &resp), "Cancel, " + who);
    }
    // The kvstore.
    auto kv = v1::KvStore::NewStub(Channel(kv_port, secret));
    {
      grpc::ClientContext ctx;
      v1::PutRequest req;
      req.set_tier(v1::TIER_G3_ROCKSDB);
      req.set_key("stranger-key");
      req.set_value("poison");
      v1::PutResponse resp;
      ExpectRefused(kv->Put(&ctx, req, &resp), "Put, " + who);
    }
    {
      grpc::ClientContext ctx;
      v1::PinRequest req;
      req.set_key("stranger-key");
      req.set_pin(true);
      v1::PinResponse resp;
      ExpectRefused(kv->Pin(&ctx, req, &resp), "Pin, " + who);
    }
    {
      grpc::ClientContext ctx;
      v1::GetRequest req;
      req.set_tier(v1::TIER_G3_ROCKSDB);
      req.set_key("stranger-key");
      v1::GetResponse resp;
      ExpectRefused(kv->Get(&ctx, req, &resp), "Get, " + who);
    }
    {
      grpc::ClientContext ctx;
      v1::BatchPutRequest req;
      req.set_tier(v1::TIER_G3_ROCKSDB);
      v1::BatchPutResponse resp;
      ExpectRefused(kv->BatchPut(&ctx, req, &resp), "BatchPut, " + who);
    }
    {
      grpc::ClientContext ctx;
      v1::HelloRequest req;
      v1::HelloResponse resp;
      ExpectRefused(kv->Hello(&ctx, req, &resp), "Hello, " + who);
    }
  }

  // A captured call proof: good once, refused when replayed, and not valid for another method.
  auto plain = v1::KvStore::NewStub(Channel(kv_port, ""));
  const std::string captured = runtime::MakeClusterAuthToken(
      Secret(), "/epd.v1.KvStore/Get", absl::ToUnixMillis(absl::Now()),
      common::ToHex(common::RandomBytes(16)));
  v1::GetRequest get;
  get.set_tier(v1::TIER_G3_ROCKSDB);
  get.set_key("stranger-key");
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(runtime::kClusterAuthMetadata, captured);
    v1::GetResponse resp;
    // Authenticated: the key is simply not there (NOT_FOUND), not UNAUTHENTICATED.
    grpc::Status s = plain->Get(&ctx, get, &resp);
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << "the first use of a good proof: " << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(runtime::kClusterAuthMetadata, captured);
    v1::GetResponse resp;
    grpc::Status s = plain->Get(&ctx, get, &resp);
    ExpectRefused(s, "a replayed Get proof");
    EXPECT_NE(s.error_message().find("replayed"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(runtime::kClusterAuthMetadata, captured);
    v1::PutRequest put;
    put.set_tier(v1::TIER_G3_ROCKSDB);
    put.set_key("stranger-key");
    put.set_value("poison");
    v1::PutResponse resp;
    ExpectRefused(plain->Put(&ctx, put, &resp), "a Get proof used for Put");
  }

  // The kvstore's UCX handshake, played by hand. Its address and fingerprint, as an insider sees
  // them (a stranger could sniff them).
  v1::HelloResponse hello;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(v1::KvStore::NewStub(Channel(kv_port, Secret()))
                    ->Hello(&ctx, v1::HelloRequest(), &hello)
                    .ok());
  }
  ASSERT_FALSE(hello.transfer_address().empty());
  const std::string fp = hello.transfer_fingerprint();
  RawPeer raw;
  ASSERT_TRUE(raw.Start().ok());
  // One handshake up to the daemon's challenge: returns its reply.
  auto open = [&](transfer::PeerId* peer, std::string* nonce_c) {
    auto p = raw.Connect(hello.transfer_address());
    EXPECT_TRUE(p.ok()) << p.status();
    *peer = p.value_or(0);
    *nonce_c = common::RandomBytes(32);
    v1::TransferControl h;
    h.mutable_hello()->set_protocol_version(3);
    h.mutable_hello()->set_config_fingerprint(fp);
    h.mutable_hello()->set_nonce(*nonce_c);
    h.mutable_hello()->set_node_name("stranger");
    raw.Send(*peer, h);
    v1::TransferControl reply = raw.Next();
    EXPECT_TRUE(reply.has_hello_reply());
    EXPECT_TRUE(reply.hello_reply().accepted()) << reply.hello_reply().error();
    return reply.hello_reply();
  };
  auto prove = [&](transfer::PeerId peer, const std::string& proof) {
    v1::TransferControl m;
    m.mutable_hello_proof()->set_proof(proof);
    raw.Send(peer, m);
    v1::TransferControl done = raw.Next();
    EXPECT_TRUE(done.has_hello_done());
    return done.hello_done();
  };
  // 1. A wrong secret: refused.
  transfer::PeerId peer = 0;
  std::string nonce_c;
  v1::TransferHelloReply challenge = open(&peer, &nonce_c);
  // The daemon proved the real secret to us; a stranger cannot check or use that proof.
  EXPECT_EQ(challenge.proof(),
            common::HmacSha256(Secret(), Transcript("server", nonce_c, challenge.nonce(), fp)));
  v1::TransferHelloDone done = prove(
      peer, common::HmacSha256(kStranger, Transcript("client", nonce_c, challenge.nonce(), fp)));
  EXPECT_FALSE(done.accepted());
  EXPECT_NE(done.error().find("proof refused"), std::string::npos) << done.error();
  raw.Close(peer);
  // 2. An insider's proof (the right secret) is accepted...
  challenge = open(&peer, &nonce_c);
  const std::string captured_proof =
      common::HmacSha256(Secret(), Transcript("client", nonce_c, challenge.nonce(), fp));
  done = prove(peer, captured_proof);
  EXPECT_TRUE(done.accepted()) << done.error();
  raw.Close(peer);
  // 3. ...and refused when a stranger who captured it replays it on a new connection (same
  // client nonce too: the daemon's fresh nonce makes the old proof worthless).
  {
    auto p = raw.Connect(hello.transfer_address());
    ASSERT_TRUE(p.ok()) << p.status();
    peer = *p;
    v1::TransferControl h;
    h.mutable_hello()->set_protocol_version(3);
    h.mutable_hello()->set_config_fingerprint(fp);
    h.mutable_hello()->set_nonce(nonce_c);
    raw.Send(peer, h);
    v1::TransferControl reply = raw.Next();
    ASSERT_TRUE(reply.has_hello_reply());
    EXPECT_NE(reply.hello_reply().nonce(), challenge.nonce());
    done = prove(peer, captured_proof);
    EXPECT_FALSE(done.accepted()) << "a replayed handshake proof was accepted";
    raw.Close(peer);
  }
  // 4. An offer before a finished handshake is not taken (the connection is closed).
  // Nothing the daemon sent holds the secret.
  EXPECT_EQ(raw.all_bytes().find(Secret()), std::string::npos);

  // The cluster still serves with its own workers.
  const auto g = Generate(c.grpc_port(), Prompt(40, 1), 4);
  EXPECT_TRUE(g.status.ok()) << g.status.error_message() << c.Logs();
  EXPECT_EQ(g.ids.size(), 4u);
  const std::string logs = c.Logs();
  EXPECT_EQ(logs.find(Secret()), std::string::npos) << "a log holds the secret";
}

// No built-in secret: a binary started without one (or with a short one) refuses to start and
// says how to give one.
TEST(OutsiderTest, ABinaryWithoutAClusterSecretRefusesToStart) {
  testing::TempDir dir;
  for (const std::string& secret : {std::string(), std::string("short")}) {
    testing::Subprocess kv = testing::Subprocess::Start(
        {testing::BinaryPath("epd-kvstore"), "--data-dir", dir.File("kv"), "--grpc-port", "0",
         "--metrics-port", "0"},
        dir.File("kv.log"), {{"EPD_CLUSTER_SECRET", secret}});
    const std::optional<int> rc = kv.Wait(std::chrono::seconds(20));
    ASSERT_TRUE(rc.has_value()) << kv.ReadLog();
    EXPECT_NE(*rc, 0);
    EXPECT_NE(kv.ReadLog().find("--cluster-secret-file"), std::string::npos) << kv.ReadLog();
    EXPECT_NE(kv.ReadLog().find("$EPD_CLUSTER_SECRET"), std::string::npos) << kv.ReadLog();
  }
}

// The router owns request identity (docs/security.md): a client's gRPC request_id is only a
// label, so two requests that run at once through encoder -> prefill -> decode with the same one
// (hand-offs, worker jobs and cancels are keyed by the internal id) each get their own output,
// the one each gets alone.
TEST_F(OutsiderE2ETest, TwoConcurrentRequestsWithTheSameGrpcRequestIdEachGetTheirOwnOutput) {
  testing::RealCluster c({.model_dir = testing::NanoModelDirTest::model_dir()});
  ASSERT_GT(c.grpc_port(), 0);
  const std::vector<int32_t> pa = Prompt(300, 3), pb = Prompt(280, 4);
  const testing::Generation want_a = Generate(c.grpc_port(), pa, 24);
  const testing::Generation want_b = Generate(c.grpc_port(), pb, 24);
  ASSERT_TRUE(want_a.status.ok()) << want_a.status.error_message() << c.Logs();
  ASSERT_TRUE(want_b.status.ok()) << want_b.status.error_message();
  ASSERT_NE(want_a.ids, want_b.ids);
  for (int round = 0; round < 2; ++round) {
    testing::Generation a, b;
    testing::GenerateOptions o;
    o.request_id = "same-id";
    std::thread ta([&] { a = Generate(c.grpc_port(), pa, 24, o); });
    std::thread tb([&] { b = Generate(c.grpc_port(), pb, 24, o); });
    ta.join();
    tb.join();
    EXPECT_TRUE(a.status.ok()) << a.status.error_message() << c.Logs();
    EXPECT_TRUE(b.status.ok()) << b.status.error_message();
    EXPECT_EQ(a.ids, want_a.ids) << "round " << round;
    EXPECT_EQ(b.ids, want_b.ids) << "round " << round;
  }
}

}  // namespace
}  // namespace epd
