#include "services/cli/tokenize.h"

#include <CLI/CLI.hpp>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "tokenizer/tokenizer.h"

namespace epd::services {

void AddTokenizeFlags(CLI::App& app, TokenizeOptions* o) {
  app.add_option("--model", o->model_dir, "Model directory with tokenizer.json")->required();
  app.add_option("--in", o->in, "UTF-8 text file to encode")->required();
  app.add_option("--out", o->out, "Output file: raw little-endian int32 token ids")->required();
}

absl::Status Tokenize(const TokenizeOptions& o, int64_t* n_tokens) {
  auto tok = model::Tokenizer::FromFile(o.model_dir + "/tokenizer.json");
  if (!tok.ok()) return tok.status();
  std::ifstream in(o.in, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", o.in));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::vector<int32_t> ids = (*tok)->Encode(ss.str());
  std::ofstream out(o.out, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", o.out));
  for (int32_t id : ids) {  // little-endian on every supported host; written byte by byte
    const auto u = static_cast<uint32_t>(id);
    const char b[4] = {static_cast<char>(u & 0xFF), static_cast<char>((u >> 8) & 0xFF),
                       static_cast<char>((u >> 16) & 0xFF), static_cast<char>(u >> 24)};
    out.write(b, 4);
  }
  out.flush();
  if (!out) return absl::InternalError(absl::StrCat("write failed: ", o.out));
  if (n_tokens != nullptr) *n_tokens = static_cast<int64_t>(ids.size());
  return absl::OkStatus();
}

int RunTokenizeCommand(const TokenizeOptions& o) {
  int64_t n = 0;
  if (auto s = Tokenize(o, &n); !s.ok()) {
    std::cerr << "epd tokenize: " << s.message() << "\n";
    return 1;
  }
  std::cout << "epd tokenize: " << n << " tokens -> " << o.out << "\n";
  return 0;
}

}  // namespace epd::services
