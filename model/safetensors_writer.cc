#include "model/safetensors_writer.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace epd::model {
namespace {

absl::Status WriteAtomically(const std::string& path, const std::string& head,
                             const std::vector<const std::string*>& parts) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::InternalError(absl::StrCat("cannot create ", tmp));
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    for (const std::string* p : parts)
      out.write(p->data(), static_cast<std::streamsize>(p->size()));
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("write failed: ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<size_t> SafetensorsDtypeSize(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8}};
  auto it = sizes.find(dtype);
  if (it == sizes.end())
    return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype \"", dtype, "\""));
  return it->second;
}

absl::Status SafetensorsWriter::Add(const std::string& name, const std::string& dtype,
                                    std::vector<int64_t> shape, std::string data) {
  if (name.empty() || name == "__metadata__") {
    return absl::InvalidArgumentError(absl::StrCat("invalid tensor name \"", name, "\""));
  }
  if (tensors_.contains(name))
    return absl::AlreadyExistsError(absl::StrCat("tensor ", name, " added twice"));
  auto esize = SafetensorsDtypeSize(dtype);
  if (!esize.ok())
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", esize.status().message()));
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": negative dimension"));
    n *= static_cast<uint64_t>(d);
  }
  if (n * *esize != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", data.size(), " bytes given, shape and dtype need ", n * *esize));
  }
  data_bytes_ += data.size();
  tensors_.emplace(name, Tensor{dtype, std::move(shape), std::move(data)});
  return absl::OkStatus();
}

std::vector<std::string> SafetensorsWriter::names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

absl::Status SafetensorsWriter::Write(const std::string& path,
                                      const std::map<std::string, std::string>& metadata) const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t off = 0;
  std::vector<const std::string*> parts;
  for (const auto& [name, t] : tensors_) {  // std::map: byte-wise name order
    header[name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.data.size()}}};
    off += t.data.size();
    parts.push_back(&t.data);
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string head(8, '\0');
  const uint64_t len = h.size();
  for (int i = 0; i < 8; ++i)
    head[static_cast<size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xFF);
  head += h;
  return WriteAtomically(path, head, parts);
}

absl::Status WriteSafetensorsIndex(const std::string& path, uint64_t total_size,
                                   const std::map<std::string, std::string>& weight_map) {
  nlohmann::ordered_json j;
  j["metadata"] = {{"total_size", total_size}};
  j["weight_map"] = weight_map;
  const std::string text = j.dump(2) + "\n";
  return WriteAtomically(path, text, {});
}

}  // namespace epd::model
