#include "services/router/utf8.h"

namespace epd::services::router {

int Utf8SequenceLength(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlongs
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    if (i + k >= s.size()) return -1;
    const unsigned char x = b(i + k);
    const unsigned char min = k == 1 ? lo : 0x80, max = k == 1 ? hi : 0xBF;
    if (x < min || x > max) return 0;
  }
  return len;
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const int n = Utf8SequenceLength(s, i);
    if (n <= 0) return false;
    i += n;
  }
  return true;
}

std::string TakeCompleteUtf8(std::string* pending, bool flush) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  std::string out;
  size_t i = 0;
  const std::string_view s = *pending;
  while (i < s.size()) {
    const int n = Utf8SequenceLength(s, i);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else if (n == 0) {
      out.append(kReplacement);
      ++i;
    } else {  // truncated tail
      if (!flush) break;
      out.append(kReplacement);
      i = s.size();
    }
  }
  pending->erase(0, i);
  return out;
}

}  // namespace epd::services::router
