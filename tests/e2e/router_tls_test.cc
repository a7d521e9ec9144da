// TLS on the router's public ports (docs/router.md, TLS): a CA and a server certificate for
// 127.0.0.1 are generated at test time with the openssl CLI; the real epd-router serves HTTPS and
// gRPC over TLS with them while an epd-fake-worker registers on the plaintext worker port. A
// client that trusts the CA (and verifies the certificate) is served on both ports; a client that
// trusts another CA, or speaks plaintext, is refused.
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "epd/v1/inference.grpc.pb.h"
#include "tests/testing/subprocess.h"

namespace epd {
namespace {

using epd::testing::BinaryPath;
using epd::testing::RunCommand;
using epd::testing::Subprocess;
using epd::testing::TempDir;
using epd::testing::WaitForPortFile;
using nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A CA `name`.pem/.key, and, signed by it, server.pem/.key for 127.0.0.1 + localhost.
bool MakeCa(const TempDir& d, const std::string& name) {
  std::string out;
  return RunCommand("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
                    "-days 1 -subj /CN=" + name + " -keyout " + d.File(name + ".key") +
                        " -out " + d.File(name + ".pem") + " 2>&1",
                    &out) == 0;
}

bool MakeServerCert(const TempDir& d, const std::string& ca) {
  std::ofstream(d.File("san.ext")) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
  std::string out;
  return RunCommand("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
                    "-subj /CN=localhost -keyout " + d.File("server.key") + " -out " +
                        d.File("server.csr") + " 2>&1",
                    &out) == 0 &&
         RunCommand("openssl x509 -req -days 1 -in " + d.File("server.csr") + " -CA " +
                        d.File(ca + ".pem") + " -CAkey " + d.File(ca + ".key") +
                        " -CAcreateserial -extfile " + d.File("san.ext") + " -out " +
                        d.File("server.pem") + " 2>&1",
                    &out) == 0;
}

class RouterTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(MakeCa(dir_, "ca"));
    ASSERT_TRUE(MakeCa(dir_, "other-ca"));
    ASSERT_TRUE(MakeServerCert(dir_, "ca"));
    const std::string ports = dir_.File("router.json");
    router_ = Subprocess::Start(
        {BinaryPath("epd-router"), "--metrics-port", "0", "--http-port", "0", "--grpc-port", "0",
         "--worker-grpc-port", "0", "--port-file", ports, "--heartbeat-interval-ms", "200",
         "--tls-cert", dir_.File("server.pem"), "--tls-key", dir_.File("server.key")},
        dir_.File("router.log"));
    auto http = WaitForPortFile(ports, "http", std::chrono::seconds(20));
    ASSERT_TRUE(http.has_value()) << router_.ReadLog();
    http_port_ = *http;
    grpc_port_ = *WaitForPortFile(ports, "grpc", std::chrono::seconds(1));
    auto worker_port = WaitForPortFile(ports, "worker_grpc", std::chrono::seconds(1));
    ASSERT_TRUE(worker_port.has_value()) << router_.ReadLog();
    const std::string wports = dir_.File("d0.json");
    worker_ = Subprocess::Start(
        {BinaryPath("epd-fake-worker"), "--metrics-port", "0", "--port-file", wports, "--router",
         "127.0.0.1:" + std::to_string(*worker_port), "--pool", "decode", "--worker-id", "d0"},
        dir_.File("d0.log"));
    ASSERT_TRUE(WaitForPortFile(wports, "registered", std::chrono::seconds(20)).has_value())
        << worker_.ReadLog();
  }

  std::unique_ptr<httplib::SSLClient> Https(const std::string& ca) {
    auto cli = std::make_unique<httplib::SSLClient>("127.0.0.1", http_port_);
    if (!ca.empty()) cli->set_ca_cert_path(dir_.File(ca + ".pem").c_str());
    cli->enable_server_certificate_verification(true);
    cli->set_connection_timeout(10, 0);
    cli->set_read_timeout(30, 0);
    return cli;
  }

  grpc::Status Generate(std::shared_ptr<grpc::ChannelCredentials> creds, std::string* text) {
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port_), creds);
    auto stub = epd::v1::Inference::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    epd::v1::GenerateRequest req;
    req.set_model("epd-nano");
    req.set_prompt("tls!");
    auto reader = stub->Generate(&ctx, req);
    epd::v1::GenerateResponse m;
    while (reader->Read(&m)) *text += m.text();
    return reader->Finish();
  }

  TempDir dir_;
  Subprocess router_;
  Subprocess worker_;
  int http_port_ = 0;
  int grpc_port_ = 0;
};

TEST_F(RouterTlsTest, HttpsClientThatVerifiesTheCertificateIsServed) {
  auto cli = Https("ca");
  auto res = cli->Post("/v1/completions",
                       json{{"model", "epd-nano"}, {"prompt", "hello tls"}, {"max_tokens", 5}}.dump(),
                       "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error()) << "\n" << router_.ReadLog();
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["choices"][0]["text"], "slt o");
  // The verified session carries the streaming API too.
  std::string sse;
  auto stream = cli->Post("/v1/chat/completions",
                          json{{"model", "epd-nano"},
                               {"messages", {{{"role", "user"}, {"content", "x"}}}},
                               {"max_tokens", 3},
                               {"stream", true}}
                              .dump(),
                          "application/json");
  ASSERT_TRUE(stream);
  EXPECT_EQ(stream->status, 200);
  EXPECT_NE(stream->body.find("data: [DONE]"), std::string::npos) << stream->body;
}

TEST_F(RouterTlsTest, HttpsClientThatDoesNotTrustTheCertificateIsRefused) {
  for (const std::string ca : {"other-ca", ""}) {  // another CA; the system store
    auto cli = Https(ca);
    auto res = cli->Get("/v1/models");
    EXPECT_FALSE(res) << "served without trusting the certificate (ca '" << ca << "')";
    if (!res) {
      EXPECT_EQ(res.error(), httplib::Error::SSLServerVerification)
          << httplib::to_string(res.error());
    }
  }
  // Plain HTTP on the TLS port gets no API response.
  httplib::Client plain("127.0.0.1", http_port_);
  plain.set_read_timeout(5, 0);
  auto res = plain.Get("/v1/models");
  EXPECT_TRUE(!res || res->status != 200);
  // The router is still up and serving verified clients.
  auto ok = Https("ca")->Get("/v1/models");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

TEST_F(RouterTlsTest, GrpcOverTlsVerifiesTheServerCertificate) {
  grpc::SslCredentialsOptions trusted;
  trusted.pem_root_certs = ReadFile(dir_.File("ca.pem"));
  std::string text;
  grpc::Status s = Generate(grpc::SslCredentials(trusted), &text);
  EXPECT_TRUE(s.ok()) << s.error_message() << "\n" << router_.ReadLog();
  EXPECT_EQ(text, "!slt");

  grpc::SslCredentialsOptions untrusted;
  untrusted.pem_root_certs = ReadFile(dir_.File("other-ca.pem"));
  text.clear();
  s = Generate(grpc::SslCredentials(untrusted), &text);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_TRUE(text.empty());

  text.clear();
  s = Generate(grpc::InsecureChannelCredentials(), &text);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_TRUE(text.empty());
}

TEST(RouterTlsStartupTest, UnreadableCertificateIsAClearError) {
  TempDir dir;
  std::ofstream(dir.File("bad.pem")) << "not a certificate\n";
  for (const auto& [cert, key] :
       std::vector<std::pair<std::string, std::string>>{{dir.File("missing.pem"), dir.File("k")},
                                                        {dir.File("bad.pem"), dir.File("bad.pem")},
                                                        {dir.File("bad.pem"), ""}}) {
    std::vector<std::string> argv = {BinaryPath("epd-router"), "--metrics-port", "0",
                                     "--http-port", "0", "--grpc-port", "0", "--tls-cert", cert};
    if (!key.empty()) argv.insert(argv.end(), {"--tls-key", key});
    auto p = Subprocess::Start(argv, dir.File("router.log"));
    EXPECT_EQ(p.Wait(std::chrono::seconds(20)), std::optional<int>(1)) << p.ReadLog();
    EXPECT_NE(p.ReadLog().find("TLS"), std::string::npos) << p.ReadLog();
  }
}

}  // namespace
}  // namespace epd
