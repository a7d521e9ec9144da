#pragma once

// Prefix-chain block hashes: hash(parent hash, the block's token ids, config fingerprint).
// xxHash3-128 over a fixed little-endian serialization, so a hash is identical across processes,
// restarts and machines. Two prompts share a block hash iff they share the whole prefix up to
// and including that block under the same config fingerprint. Thread-safe (pure functions).
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstore/types.h"

namespace epd::kvstore {

// The parent of the first block: all zero bytes.
inline constexpr BlockHash kRootParent{};

// Hash of one block. `tokens` are the block's token ids (any count; the store uses whole blocks).
BlockHash ChainHash(const BlockHash& parent, std::span<const int32_t> tokens,
                    std::string_view config_fingerprint);

// Chain hashes of every WHOLE block of `tokens` (a trailing partial block is not hashed).
// block_tokens must be > 0.
std::vector<BlockHash> ChainHashes(std::span<const int32_t> tokens, size_t block_tokens,
                                   std::string_view config_fingerprint);

// Parses a 16-byte wire key; InvalidArgument naming the size otherwise.
absl::StatusOr<BlockHash> BlockHashFromBytes(std::string_view bytes);

}  // namespace epd::kvstore
