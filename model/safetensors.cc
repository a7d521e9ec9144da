#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"

namespace epd::model {
namespace {

using Json = nlohmann::json;

bool ParseDType(const std::string& s, DType* d) {
  static const std::pair<const char*, DType> kTable[] = {
      {"BF16", DType::kBF16},      {"F16", DType::kF16},        {"F32", DType::kF32},
      {"F8_E4M3", DType::kF8E4M3}, {"F8_E8M0", DType::kF8E8M0}, {"I8", DType::kI8},
      {"U8", DType::kU8},          {"I32", DType::kI32},        {"I64", DType::kI64}};
  for (const auto& [n, v] : kTable) {
    if (s == n) {
      *d = v;
      return true;
    }
  }
  return false;
}

}  // namespace

std::string_view DTypeName(DType d) {
  switch (d) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E8M0:
      return "F8_E8M0";
    case DType::kI8:
      return "I8";
    case DType::kU8:
      return "U8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
  }
  return "?";
}

int64_t DTypeSize(DType d) {
  switch (d) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    default:
      return 1;
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string TensorView::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return absl::NotFoundError(
        absl::StrCat("safetensors: cannot open ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("safetensors: cannot stat ", path));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->size_ = st.st_size;
  if (f->size_ < 8) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(
        "safetensors: ", path, ": file too small for a header (", f->size_, " bytes)"));
  }
  f->map_ = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (f->map_ == MAP_FAILED) {
    f->map_ = nullptr;
    return absl::InternalError(absl::StrCat("safetensors: mmap failed for ", path));
  }
  const uint8_t* base = static_cast<const uint8_t*>(f->map_);
  uint64_t hlen;
  std::memcpy(&hlen, base, 8);
  if (hlen > static_cast<uint64_t>(f->size_ - 8)) {
    return absl::DataLossError(absl::StrCat("safetensors: ", path, ": header length ", hlen,
                                            " exceeds file size ", f->size_,
                                            " (truncated or bad header)"));
  }
  Json h = Json::parse(reinterpret_cast<const char*>(base + 8),
                       reinterpret_cast<const char*>(base + 8 + hlen), nullptr, false);
  if (h.is_discarded() || !h.is_object()) {
    return absl::DataLossError(
        absl::StrCat("safetensors: ", path, ": header is not a JSON object"));
  }
  const int64_t data_start = 8 + static_cast<int64_t>(hlen);
  const int64_t data_size = f->size_ - data_start;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const Json& e = it.value();
    TensorView v;
    v.name = it.key();
    v.file = path;
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(
          absl::StrCat("safetensors: ", path, ": tensor '", v.name, "': ", why));
    };
    if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() || !e.contains("shape") ||
        !e["shape"].is_array() || !e.contains("data_offsets") || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2) {
      return bad("malformed header entry");
    }
    if (!ParseDType(e["dtype"].get<std::string>(), &v.dtype)) {
      return bad(absl::StrCat("unsupported dtype ", e["dtype"].get<std::string>()));
    }
    for (const Json& s : e["shape"]) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0) return bad("bad shape");
      v.shape.push_back(s.get<int64_t>());
    }
    const Json& off = e["data_offsets"];
    if (!off[0].is_number_integer() || !off[1].is_number_integer()) return bad("bad data_offsets");
    const int64_t b = off[0].get<int64_t>(), en = off[1].get<int64_t>();
    if (b < 0 || en < b) return bad("bad data_offsets");
    if (en > data_size) {
      return bad(absl::StrCat("data ends at ", en, " but the file holds only ", data_size,
                              " data bytes (truncated shard)"));
    }
    // The element count can overflow int64 for a hostile shape; wrapped, it could match a small
    // byte range while the shape claims far more (found probing tests/fuzz/fuzz_safetensors).
    int64_t want_bytes = DTypeSize(v.dtype);
    for (int64_t d : v.shape) {
      if (__builtin_mul_overflow(want_bytes, d, &want_bytes)) {
        return bad(absl::StrCat("shape ", v.ShapeString(), " overflows a 64-bit byte size"));
      }
    }
    if (en - b != want_bytes) {
      return bad(absl::StrCat("byte size ", en - b, " does not match shape ", v.ShapeString(),
                              " x ", DTypeSize(v.dtype)));
    }
    v.data = base + data_start + b;
    v.bytes = en - b;
    f->tensors_.emplace(v.name, std::move(v));
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

absl::StatusOr<std::unique_ptr<TensorStore>> TensorStore::Open(const std::string& path,
                                                               bool log_progress) {
  namespace fs = std::filesystem;
  auto store = std::make_unique<TensorStore>();
  std::vector<std::string> shards;
  std::map<std::string, std::string> weight_map;  // from the index, if any
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    fs::path idx = fs::path(path) / "model.safetensors.index.json";
    if (fs::exists(idx)) {
      std::ifstream in(idx);
      std::stringstream ss;
      ss << in.rdbuf();
      Json j = Json::parse(ss.str(), nullptr, false);
      if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
        return absl::DataLossError(
            absl::StrCat("safetensors: ", idx.string(), ": no weight_map object"));
      }
      std::map<std::string, bool> seen;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        if (!it.value().is_string()) {
          return absl::DataLossError(
              absl::StrCat("safetensors: ", idx.string(), ": bad entry for ", it.key()));
        }
        std::string shard = it.value().get<std::string>();
        weight_map[it.key()] = shard;
        if (!seen[shard]) {
          seen[shard] = true;
          shards.push_back((fs::path(path) / shard).string());
        }
      }
    } else if (fs::exists(fs::path(path) / "model.safetensors")) {
      shards.push_back((fs::path(path) / "model.safetensors").string());
    } else {
      return absl::NotFoundError(
          absl::StrCat("safetensors: ", path,
                       " has neither model.safetensors.index.json nor model.safetensors"));
    }
  } else {
    shards.push_back(path);
  }
  int64_t bytes = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    auto f = SafetensorsFile::Open(shards[i]);
    if (!f.ok()) return f.status();
    bytes += (*f)->file_bytes();
    for (const auto& [name, view] : (*f)->tensors()) {
      if (store->index_.count(name)) {
        return absl::DataLossError(
            absl::StrCat("safetensors: tensor '", name, "' appears in two shards"));
      }
      store->index_[name] = &view;
    }
    store->files_.push_back(std::move(*f));
    if (log_progress) {
      spdlog::info("loading weights: shard {}/{} ({:.1f} MB)", i + 1, shards.size(), bytes / 1e6);
    }
  }
  for (const auto& [name, shard] : weight_map) {
    auto it = store->index_.find(name);
    if (it == store->index_.end()) {
      return absl::NotFoundError(absl::StrCat("safetensors: index names tensor '", name, "' in ",
                                              shard, " but the shard does not hold it"));
    }
  }
  store->total_bytes_ = bytes;
  return store;
}

absl::StatusOr<TensorView> TensorStore::Get(std::string_view name) const {
  auto it = index_.find(std::string(name));
  if (it == index_.end())
    return absl::NotFoundError(absl::StrCat("weights: missing tensor '", std::string(name), "'"));
  return *it->second;
}

absl::StatusOr<TensorView> TensorStore::Get(std::string_view name, DType dtype,
                                            const std::vector<int64_t>& shape) const {
  auto v = Get(name);
  if (!v.ok()) return v.status();
  if (v->dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("weights: tensor '", std::string(name),
                                                   "' has dtype ", std::string(DTypeName(v->dtype)),
                                                   ", expected ", std::string(DTypeName(dtype))));
  }
  if (v->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("weights: tensor '", std::string(name),
                                                   "' has shape ", v->ShapeString(), ", expected [",
                                                   absl::StrJoin(shape, ","), "]"));
  }
  return v;
}

std::vector<std::string> TensorStore::Names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : index_) n.push_back(k);
  return n;
}

}  // namespace epd::model
