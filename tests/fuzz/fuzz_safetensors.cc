// libFuzzer target: a .safetensors file as SafetensorsFile::Open reads it (8-byte header length,
// JSON header, dtypes, shapes, data offsets against the file size). The input is the whole file,
// served from a memfd so the real mmap path runs.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int fd = memfd_create("fuzz.safetensors", 0);
  if (fd < 0) __builtin_trap();
  if (ftruncate(fd, 0) != 0) __builtin_trap();
  size_t off = 0;
  while (off < size) {
    const ssize_t n = pwrite(fd, data + off, size - off, static_cast<off_t>(off));
    if (n <= 0) __builtin_trap();
    off += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto f = epd::model::SafetensorsFile::Open(path);
  if (f.ok()) {
    for (const auto& [name, t] : (*f)->tensors()) {
      // Every accepted tensor lies inside the file.
      if (t.bytes < 0 || t.bytes > (*f)->file_bytes()) __builtin_trap();
      (void)t.ShapeString();
      (void)t.numel();
    }
  }
  return 0;
}
