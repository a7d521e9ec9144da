#pragma once

// Test-time TLS material made with the openssl CLI: a CA and a server certificate it signs for
// 127.0.0.1 and localhost (router_tls_test, serve_tls_test).
#include <fstream>
#include <sstream>
#include <string>

#include "tests/testing/subprocess.h"

namespace epd::testing {

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A self-signed CA: `name`.pem and `name`.key in `d`.
inline bool MakeCa(const TempDir& d, const std::string& name) {
  std::string out;
  return RunCommand("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
                    "-days 1 -subj /CN=" + name + " -keyout " + d.File(name + ".key") +
                        " -out " + d.File(name + ".pem") + " 2>&1",
                    &out) == 0;
}

// server.pem / server.key in `d`, signed by the CA `ca`, for 127.0.0.1 and localhost.
inline bool MakeServerCert(const TempDir& d, const std::string& ca) {
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

}  // namespace epd::testing
