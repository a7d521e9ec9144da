#include "encoder_pool/encoder_stage.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvstore/chain_hash.h"

namespace epd::encoder_pool {
namespace {

// G2 key of the SWA snapshot at the end of the block with chain hash `h`.
std::string SnapshotKey(const kvstore::BlockHash& h) {
  return std::string(kvstore::AsBytes(h)) + "swa";
}

void Fail(PrefixReport* r, const char* op, const absl::Status& s) {
  r->errors.push_back(op);
  if (r->warning.empty()) r->warning = absl::StrCat(op, ": ", s.ToString());
}

// Errors on an empty prompt or ids out of the vocabulary.
absl::Status CheckPrompt(std::span<const int32_t> prompt, const model::ModelConfig& config) {
  if (prompt.empty()) return absl::InvalidArgumentError("encoder: empty prompt");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= config.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("encoder: prompt token ", i, " (", prompt[i],
                                                     ") is outside the vocabulary"));
  }
  return absl::OkStatus();
}

// What step 1 of Run read: P tokens as whole blocks, and the SWA snapshot at P when found.
struct StoredPrefix {
  int64_t P = 0;
  std::vector<std::string> blocks;
  std::optional<std::string> snapshot;
};

// 1. Read the prefix (no lock: I/O only).
StoredPrefix ReadPrefix(kvstore::KvStoreApi* store, const PrefixOptions& prefix,
                        const std::vector<kvstore::BlockHash>& hashes, int64_t N, int64_t B,
                        int64_t tail_rows, PrefixReport* report) {
  StoredPrefix read;
  int64_t& P = read.P;
  std::vector<std::string>& blocks = read.blocks;
  if (store != nullptr && prefix.hint > 0) {
    P = std::min(prefix.hint / B * B, EncoderStage::PrefixCap(N, tail_rows, B));
    // The whole prefix in one call (one RPC; same-host values through shared memory).
    std::vector<std::string> keys;
    keys.reserve(static_cast<size_t>(P / B));
    for (int64_t b = 0; b < P / B; ++b) keys.emplace_back(kvstore::AsBytes(hashes[b]));
    auto got = store->BatchGet(kvstore::Tier::kAuto, keys, /*stop_at_first_miss=*/true);
    if (!got.ok()) {
      Fail(report, "get", got.status());
    } else {
      for (auto& item : *got) {
        if (!item.ok()) {
          Fail(report, "get", item.status());
          break;
        }
        if (!item->found) break;  // expired/evicted since the lookup: the longest prefix read
        blocks.push_back(std::move(item->value));
      }
    }
    P = static_cast<int64_t>(blocks.size()) * B;
    if (P > 0) {
      auto snap = store->Get(kvstore::Tier::kG2, SnapshotKey(hashes[P / B - 1]));
      if (!snap.ok()) {
        Fail(report, "get", snap.status());
      } else if (snap->found) {
        read.snapshot = std::move(snap->value);
      }
    }
  }
  return read;
}

// 2. The state at P: assembled (+ replay on a snapshot miss), else fresh (read.P set to 0; with
// `repair` when the stored values were bad).
std::unique_ptr<model::SequenceState> RestoreState(const model::Model& model,
                                                   std::span<const int32_t> prompt, int64_t B,
                                                   StoredPrefix& read, bool* repair,
                                                   PrefixReport* report) {
  int64_t& P = read.P;
  std::optional<std::string>& snapshot = read.snapshot;
  std::unique_ptr<model::SequenceState> state;
  if (P > 0) {
    auto st = model::AssemblePrefixState(model, read.blocks, snapshot ? &*snapshot : nullptr, B);
    if (!st.ok() && snapshot) {
      // A bad snapshot costs a replay, not the blocks.
      auto bare = model::AssemblePrefixState(model, read.blocks, nullptr, B);
      if (bare.ok()) {
        Fail(report, "decode", st.status());
        snapshot.reset();
        st = std::move(bare);
      }
    }
    if (!st.ok()) {
      Fail(report, "decode", st.status());
      *repair = true;  // overwrite the bad values with the ones this pass computes
      P = 0;
    } else {
      state = *std::move(st);
      absl::Status replay;
      if (!snapshot) {
        replay = model::PrefixReplay(model, *state, prompt);
        report->replayed = replay.ok();
        report->replayed_tokens = replay.ok() ? model::PrefixReplayTokens(model.config(), P) : 0;
      }
      if (!replay.ok()) {
        Fail(report, "decode", replay);
        P = 0;
      } else {
        report->snapshot_hit = snapshot.has_value();
        report->blocks_fetched = P / B;
      }
    }
  }
  if (P == 0) state = model.NewSequence();
  state->cut_block_tokens = B;  // the compressor logs keep the tails CutPrefixBlocks cuts
  report->cached_tokens = P;
  return state;
}

// What step 3 of Run computed: the output, the new blocks [P, M) and the rings at M.
struct Encoded {
  std::vector<std::string> new_blocks;
  std::optional<std::string> new_snapshot;
  std::optional<model::EncoderOutput> out;
};

// 3. EncoderPass over [P, N), split at the last block boundary M so that the new blocks and the
// rings at M can be cut.
absl::Status EncodeRest(const model::Model& model, model::SequenceState& state,
                        std::span<const int32_t> prompt, int64_t tail_rows,
                        const ChunkOptions* chunks, int64_t P, int64_t M, int64_t N, int64_t B,
                        Encoded& e) {
  std::vector<std::string>& new_blocks = e.new_blocks;
  // [P, M) first when it holds new whole blocks (cut them and the rings at M), then [M, N) chained
  // to it; without new blocks, one pass over [P, N).
  std::optional<model::EncoderOutput>& out = e.out;
  // EncoderPass over [a, b), chained to `out`, cut at multiples of chunks->chunk_tokens, with the
  // chunk callback after each piece.
  // `cut_blocks`: the new blocks of each piece are cut right after it (CutPrefixBlocks rebuilds
  // compressor tails from the last call's log, which covers only that piece).
  auto pass = [&](int64_t a, int64_t b, bool cut_blocks) -> absl::Status {
    int64_t step = chunks != nullptr ? chunks->chunk_tokens : 0;
    if (cut_blocks && step % B != 0) step = 0;  // pieces must end on block boundaries
    while (a < b) {
      const int64_t end = step > 0 ? std::min(b, (a / step + 1) * step) : b;
      auto piece = model::EncoderPass(model, state, prompt.subspan(a, end - a), tail_rows,
                                      out.has_value() ? &*out : nullptr);
      if (!piece.ok()) return piece.status();
      out = *std::move(piece);
      if (chunks != nullptr && chunks->after_chunk) {
        if (absl::Status s = chunks->after_chunk(state); !s.ok()) return s;
      }
      if (cut_blocks) {
        auto cut = model::CutPrefixBlocks(model, state, prompt, a / B, end / B, B);
        if (!cut.ok()) return cut.status();
        for (std::string& v : *cut) new_blocks.push_back(std::move(v));
      }
      a = end;
    }
    return absl::OkStatus();
  };
  if (M > P) {
    if (absl::Status s = pass(P, M, /*cut_blocks=*/true); !s.ok()) return s;
    auto snap = model::CutSwaSnapshot(model, state, B);
    if (!snap.ok()) return snap.status();
    e.new_snapshot = *std::move(snap);
  }
  if (const int64_t from = std::max(P, M); from < N) {
    if (absl::Status s = pass(from, N, /*cut_blocks=*/false); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// 4. Write the new blocks that are not stored yet, then the snapshot at M (I/O, no lock).
void WriteNewBlocks(kvstore::KvStoreApi* store, const PrefixOptions& prefix,
                    const std::vector<kvstore::BlockHash>& hashes, int64_t P, int64_t B,
                    bool repair, const Encoded& e, PrefixReport* report) {
  const std::vector<std::string>& new_blocks = e.new_blocks;
  if (store != nullptr && !new_blocks.empty()) {
    const int64_t first = P / B;
    std::span<const kvstore::BlockHash> mine(hashes.data() + first, new_blocks.size());
    int64_t stored = 0;
    bool ok = true;
    if (!repair) {
      auto look = store->Lookup(prefix.fingerprint, mine);
      if (look.ok()) {
        stored = look->cached_blocks;
      } else {
        Fail(report, "lookup", look.status());
        ok = false;
      }
    }
    // The new blocks in one call; the prefix is stored up to the first block that failed.
    std::vector<kvstore::KvPut> puts;
    for (size_t i = static_cast<size_t>(stored); ok && i < new_blocks.size(); ++i)
      puts.push_back({kvstore::AsBytes(mine[i]), new_blocks[i]});
    if (!puts.empty()) {
      auto put = store->BatchPut(kvstore::Tier::kG3, puts);
      if (!put.ok()) {
        Fail(report, "put", put.status());
        ok = false;
      } else {
        for (const absl::Status& s : *put) {
          if (!s.ok()) {
            Fail(report, "put", s);
            ok = false;
            break;
          }
          ++report->blocks_written;
        }
      }
    }
    // The snapshot is only useful with every block before it stored.
    if (ok && e.new_snapshot) {
      absl::Status s = store->Put(kvstore::Tier::kG2, SnapshotKey(mine.back()), *e.new_snapshot);
      if (!s.ok()) {
        Fail(report, "put", s);
      } else {
        report->snapshot_written = true;
      }
    }
  }
}

}  // namespace

EncoderStage::EncoderStage(const model::Model& model, int64_t tail_rows)
    : model_(model), tail_rows_(tail_rows > 0 ? tail_rows : DefaultTailRows(model.config())) {}

int64_t EncoderStage::DefaultTailRows(const model::ModelConfig& c) {
  return model::DecoderTailRows(c);
}

int64_t EncoderStage::PrefixCap(int64_t n, int64_t tail_rows, int64_t block_tokens) {
  if (block_tokens <= 0 || n < tail_rows) return 0;
  return (n - tail_rows) / block_tokens * block_tokens;
}

absl::StatusOr<EncoderResult> EncoderStage::Run(std::span<const int32_t> prompt) {
  PrefixReport report;
  return Run(prompt, PrefixOptions{}, &report);
}

absl::StatusOr<EncoderResult> EncoderStage::Run(std::span<const int32_t> prompt,
                                                const PrefixOptions& prefix, PrefixReport* report,
                                                const ChunkOptions* chunks) {
  if (absl::Status s = CheckPrompt(prompt, model_.config()); !s.ok()) return s;
  *report = PrefixReport{};
  const int64_t N = static_cast<int64_t>(prompt.size());
  const int64_t B = prefix.block_tokens;
  kvstore::KvStoreApi* store = B > 0 ? prefix.store : nullptr;
  std::vector<kvstore::BlockHash> hashes;
  if (store != nullptr)
    hashes = kvstore::ChainHashes(prompt, static_cast<size_t>(B), prefix.fingerprint);

  bool repair = false;
  StoredPrefix read = ReadPrefix(store, prefix, hashes, N, B, tail_rows_, report);

  std::unique_lock<std::mutex> lock(compute_mu_);
  std::unique_ptr<model::SequenceState> state =
      RestoreState(model_, prompt, B, read, &repair, report);
  const int64_t P = read.P;

  const int64_t M = store != nullptr ? N / B * B : P;
  Encoded e;
  if (absl::Status s = EncodeRest(model_, *state, prompt, tail_rows_, chunks, P, M, N, B, e);
      !s.ok())
    return s;
  EncoderResult r;
  r.output = *std::move(e.out);
  r.state = model::SerializeState(model_.config(), *state);
  lock.unlock();

  WriteNewBlocks(store, prefix, hashes, P, B, repair, e, report);
  return r;
}

}  // namespace epd::encoder_pool
