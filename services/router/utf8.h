#pragma once

// UTF-8 helpers shared by the router's validation and detokenizers.
#include <cstddef>
#include <string>
#include <string_view>

namespace epd::services::router {

// Length of the well-formed UTF-8 sequence starting at s[i] (1-4), 0 if the bytes there are not
// well-formed, -1 if they are a valid but truncated prefix (needs more bytes).
int Utf8SequenceLength(std::string_view s, size_t i);

// True if `s` is entirely well-formed UTF-8 (RFC 3629: no overlongs, no surrogates).
bool IsValidUtf8(std::string_view s);

// Moves the complete characters at the front of *pending to the returned string. Ill-formed
// bytes become U+FFFD; a truncated sequence at the end stays in *pending unless `flush`.
std::string TakeCompleteUtf8(std::string* pending, bool flush);

}  // namespace epd::services::router
