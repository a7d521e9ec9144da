// `epd serve --tls-cert --tls-key` (docs/router.md, TLS): the launcher passes the certificate to
// the router, whose OpenAI HTTP and gRPC ports then speak TLS, while the real encoder, prefill and
// decode workers register on the router's plaintext worker port. A client that verifies the
// certificate against the test CA gets a chat completion from the real model over HTTPS and a
// Generate over gRPC TLS; Ctrl-C stops the cluster.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/e2e/serve_cluster.h"
#include "tests/e2e/tls_certs.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::ServeCluster;
using epd::testing::Subprocess;
using epd::testing::TempDir;

TEST(ServeTlsTest, EpdServeWithTlsServesVerifyingHttpsAndGrpcClients) {
  TempDir dir;
  ASSERT_TRUE(epd::testing::MakeCa(dir, "ca"));
  ASSERT_TRUE(epd::testing::MakeServerCert(dir, "ca"));
  ServeCluster cluster({"--tls-cert", dir.File("server.pem"), "--tls-key", dir.File("server.key")});
  Subprocess& serve = cluster.serve();
  ASSERT_TRUE(cluster.WaitReady()) << serve.ReadLog();
  const int http_port = cluster.http_port();
  const int grpc_port = cluster.grpc_port();
  EXPECT_NE(serve.ReadLog().find("https://127.0.0.1:" + std::to_string(http_port)),
            std::string::npos);

  httplib::SSLClient cli("127.0.0.1", http_port);
  cli.set_ca_cert_path(dir.File("ca.pem").c_str());
  cli.enable_server_certificate_verification(true);
  cli.set_read_timeout(120, 0);
  const nlohmann::json req = {{"model", "epd-nano"},
                              {"messages", {{{"role", "user"}, {"content", "hello over tls"}}}},
                              {"max_tokens", 6}};
  auto res = cli.Post("/v1/chat/completions", req.dump(), "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error()) << "\n" << serve.ReadLog();
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_GT(nlohmann::json::parse(res->body)["usage"]["completion_tokens"].get<int>(), 0);

  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = epd::testing::ReadFile(dir.File("ca.pem"));
  auto stub = epd::v1::Inference::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(grpc_port), grpc::SslCredentials(ssl)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  epd::v1::GenerateRequest g;
  g.set_model("epd-nano");
  g.set_prompt("hello");
  g.mutable_sampling()->set_max_tokens(4);
  auto reader = stub->Generate(&ctx, g);
  epd::v1::GenerateResponse m;
  int tokens = 0;
  while (reader->Read(&m)) tokens += m.token_ids_size();
  grpc::Status s = reader->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  // Up to max_tokens: the trained demo model may end its answer (EOS) sooner.
  EXPECT_GE(tokens, 1);
  EXPECT_LE(tokens, 4);

  // A plaintext client of the public HTTP port is not served. The server may close the
  // connection while the client still writes its body (a SIGPIPE, which killed this test once
  // under load before tests/testing/test_main.cc caught it).
  httplib::Client plain("127.0.0.1", http_port);
  plain.set_read_timeout(5, 0);
  auto p = plain.Post("/v1/chat/completions", req.dump(), "application/json");
  EXPECT_TRUE(!p || p->status != 200);

  kill(serve.pid(), SIGINT);
  EXPECT_TRUE(serve.Wait(std::chrono::seconds(60)).has_value()) << serve.ReadLog();
}

}  // namespace
}  // namespace epd
