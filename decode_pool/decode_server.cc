#include "decode_pool/decode_server.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "absl/strings/str_cat.h"
#include "decode_pool/decode_batcher.h"
#include "decode_pool/decode_stage.h"
#include "decode_pool/dspark/verifier.h"
#include "grammar/grammar.h"
#include "model/sequence_state.h"
#include "tokenizer/tokenizer.h"
#include "prometheus/counter.h"
#include "spdlog/spdlog.h"

namespace epd::decode_pool {
namespace {

model::SamplingParams FromProto(const epd::v1::SamplingParams& p) {
  model::SamplingParams s;
  s.temperature = p.temperature();
  s.top_p = p.top_p() > 0.f ? p.top_p() : 1.f;
  s.top_k = p.top_k();
  s.min_p = p.min_p();
  s.repetition_penalty = p.repetition_penalty() > 0.f ? p.repetition_penalty() : 1.f;
  s.frequency_penalty = p.frequency_penalty();
  s.presence_penalty = p.presence_penalty();
  s.seed = p.has_seed() ? p.seed() : 0;
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  if (p.max_tokens() > 0) s.max_tokens = p.max_tokens();
  s.top_logprobs = p.top_logprobs();
  // Stop strings are validated here but matched by the router, which holds the detokenizer
  // and cancels this job on a match (docs/dspark.md, "Decode loop").
  s.stop_strings.assign(p.stop().begin(), p.stop().end());
  return s;
}

// The vocabulary's token bytes for grammar masks (tokenizer.json beside the model); added and
// special tokens are never allowed by a mask (their text is dropped or has protocol meaning).
std::shared_ptr<const grammar::TokenMasker> LoadMasker(const worker::WorkerSetup& setup) {
  if (setup.model_dir.empty() || setup.model == nullptr) return nullptr;
  auto tok = model::Tokenizer::FromFile(setup.model_dir + "/tokenizer.json");
  if (!tok.ok()) {
    spdlog::warn("decode: no tokenizer for constrained decoding: {}",
                 std::string(tok.status().message()));
    return nullptr;
  }
  const int64_t vocab = setup.model->config().vocab_size;
  std::vector<std::string> bytes(static_cast<size_t>(vocab));
  std::vector<int32_t> excluded;
  for (int32_t id = 0; id < vocab; ++id) {
    if (id < (*tok)->vocab_size() && (*tok)->IsAddedToken(id)) excluded.push_back(id);
    const int32_t one[1] = {id};
    auto b = (*tok)->Decode(one, /*skip_special=*/false);
    if (b.ok()) bytes[static_cast<size_t>(id)] = *std::move(b);
  }
  return std::make_shared<grammar::TokenMasker>(
      bytes, excluded, static_cast<int32_t>(setup.model->config().eos_token_id));
}

// The pool's capacity: --kv-pool-bytes, else sized from the backend's memory and split among
// the decode workers that share it (--kv-pool-share).
int64_t PoolCapacity(int64_t flag, int share, const model::Model& model) {
  if (flag > 0) return flag;
  const int64_t all =
      model::DefaultKvPoolCapacity(model.backend(), model.options().scratch_cache_bytes);
  return std::max<int64_t>(1, all / std::max(1, share));
}

DecodeStageOptions WithSetup(DecodeStageOptions o, const worker::WorkerSetup& setup) {
  o.dspark = setup.dspark;
  if (!o.masker) o.masker = LoadMasker(setup);
  return o;
}

class DecodeHandler final : public worker::JobHandler {
 public:
  DecodeHandler(const worker::WorkerSetup& setup, const DecodeStageOptions& options)
      : setup_(setup),
        stage_(*setup.model, WithSetup(options, setup)),
        handoff_mismatch_(prometheus::BuildCounter()
                              .Name("epd_dspark_handoff_mismatch_total")
                              .Help("Hand-offs refused because the DSpark setting of prefill "
                                    "and decode differ")
                              .Register(*setup.registry)
                              .Add({})),
        batcher_(*setup.model, stage_, *setup.registry, setup.batch_size, {}) {
    setup_.model->kv_pool().SetCapacity(
        PoolCapacity(options.kv_pool_bytes, options.kv_pool_share, *setup_.model));
    batcher_.UpdatePoolGauges();
  }

  absl::Status Run(const epd::v1::Job& job, const worker::Emit& emit,
                   const std::atomic<bool>& cancelled) override {
    const model::ModelConfig& c = setup_.model->config();
    if (absl::Status s = worker::CheckJobFingerprint(job, setup_.fingerprint); !s.ok()) return s;
    const std::vector<int32_t> prompt(job.prompt_ids().begin(), job.prompt_ids().end());
    const int64_t n = static_cast<int64_t>(prompt.size());
    if (n <= 0) return absl::InvalidArgumentError("decode: empty prompt");
    const model::SamplingParams params = FromProto(job.sampling());
    std::shared_ptr<const grammar::Grammar> constraint;
    if (!job.sampling().constraint().empty()) {
      auto g = grammars_.Get(job.sampling().constraint());
      if (!g.ok())
        return absl::InvalidArgumentError(
            absl::StrCat("decode: constraint: ", g.status().message()));
      constraint = *std::move(g);
    }
    // n > 1: one hand-off, then n sequences forked from it: the received state is deserialized
    // into the KV pool once and each choice starts from a copy, sharing every block until it
    // writes (copy-on-write: the choices differ only in their own tail blocks); choice i samples
    // with its own seed (choice 0 keeps the request's). The batching loop starts them when the
    // pool has room (admission).
    const int choices = std::max(1, job.sampling().n());
    auto params_of = [&](int i) {
      model::SamplingParams p = params;
      if (i > 0) p.seed = params.seed + static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull;
      return p;
    };
    std::vector<DecodeBatcher::StartFn> starts;
    if (job.prev_worker_id().empty()) {
      auto shared_prompt = std::make_shared<const std::vector<int32_t>>(prompt);
      for (int i = 0; i < choices; ++i) {
        starts.push_back([this, shared_prompt, p = params_of(i), constraint] {
          return stage_.StartFromPrompt(*shared_prompt, p, constraint);
        });
      }
    } else {
      std::vector<worker::SegmentShape> shapes = worker::ExpectedStateShapes(c, n, true);
      shapes.push_back(worker::LogitsShape(c));
      // The header's dspark field says whether the state carries DSpark state: this worker's
      // setting, as prefill sends its own (the transfer engine refuses an offer whose field
      // differs; DSparkHandoffReceiveError below names the switch).
      worker::HandoffHeader h{job.request_id(), setup_.fingerprint, n, 0, setup_.dspark};
      auto got =
          setup_.handoff->Receive(worker::BuildHandoffManifest(c, h, shapes), shapes,
                                  absl::Milliseconds(setup_.handoff_deadline_ms), &cancelled);
      if (!got.ok()) {
        bool mismatch = false;
        const absl::Status e = DSparkHandoffReceiveError(setup_.dspark, got.status(), &mismatch);
        if (mismatch) handoff_mismatch_.Increment();
        return absl::Status(e.code(), absl::StrCat("prefill -> decode hand-off: ", e.message()));
      }
      if (setup_.dspark) {  // drafting needs the DSpark input (main_hidden) and draft rings
        if (absl::Status d = CheckDSparkHandoff(true, HandoffHasDSparkState(c, *got)); !d.ok()) {
          handoff_mismatch_.Increment();
          return absl::Status(d.code(), absl::StrCat("prefill -> decode hand-off: ", d.message()));
        }
      }
      auto logits = worker::UnpackLogits(*got);
      if (!logits.ok()) return logits.status();
      got->pop_back();  // the logits segment
      auto segs = std::make_shared<const std::vector<model::StateSegment>>(*std::move(got));
      auto lg = std::make_shared<const std::vector<float>>(*std::move(logits));
      auto shared_prompt = std::make_shared<const std::vector<int32_t>>(prompt);
      if (choices == 1) {
        starts.push_back([this, segs, lg, shared_prompt, p = params_of(0), constraint] {
          return stage_.Start(*segs, *lg, p, *shared_prompt, constraint);
        });
      } else {
        // The received state, deserialized by the first choice to start (the loop thread starts
        // them, one at a time); released with the last closure.
        auto proto = std::make_shared<std::unique_ptr<model::SequenceState>>();
        for (int i = 0; i < choices; ++i) {
          starts.push_back([this, segs, lg, shared_prompt, proto, p = params_of(i),
                            constraint]() -> absl::StatusOr<std::unique_ptr<DecodeSequence>> {
            if (*proto == nullptr) {
              auto st = model::DeserializeState(*setup_.model, *segs);
              if (!st.ok()) return st.status();
              *proto = *std::move(st);
            }
            return stage_.StartWithState(std::make_unique<model::SequenceState>(**proto), *lg, p,
                                         *shared_prompt, constraint);
          });
        }
      }
    }
    // Hand the sequences to the batcher (which admits them into the KV pool); stream what they
    // produce, each message for one choice (SubmitResponse.index). Each choice's state needs
    // global KV + the packed SWA rings and compressor tails (a copy of a shared state copies them
    // on its first step).
    const std::shared_ptr<DecodeBatcher::Ticket> ticket = batcher_.Submit(
        std::move(starts), setup_.model->KvBytesFor(n) + setup_.model->FixedStateBytes());
    absl::Status result = absl::OkStatus();
    while (!DecodeBatcher::Finished(*ticket) && result.ok()) {
      std::vector<DecodeBatcher::Chunk> fresh;
      result = batcher_.Collect(*ticket, std::chrono::milliseconds(20), &fresh);
      if (!result.ok()) break;
      if (cancelled.load()) {
        result = absl::CancelledError("cancelled");
        break;
      }
      for (const DecodeBatcher::Chunk& f : fresh) {
        if (!emit(ToResponse(job.request_id(), f))) {
          result = absl::CancelledError("the router's stream is gone");
          break;
        }
      }
    }
    batcher_.Release(*ticket);
    return result;
  }

 private:
  static epd::v1::SubmitResponse ToResponse(const std::string& request_id,
                                            const DecodeBatcher::Chunk& f) {
    epd::v1::SubmitResponse r;
    r.set_request_id(request_id);
    r.set_index(f.index);
    for (int32_t t : f.tokens) r.add_token_ids(t);
    // Logprobs (top_logprobs = n > 0): per token, the chosen token then its top n.
    for (const model::Logprobs& lp : f.logprobs) {
      auto add = [&](const model::TokenLogprob& x) {
        epd::v1::TokenLogprob* o = r.add_top_logprobs();
        o->set_token_id(x.token);
        o->set_logprob(x.logprob);
      };
      add(lp.chosen);
      for (const model::TokenLogprob& x : lp.top) add(x);
    }
    if (f.finished) r.set_finish_reason(f.finish_reason);
    return r;
  }

  worker::WorkerSetup setup_;
  DecodeStage stage_;
  grammar::GrammarCache grammars_;  // compiled constraints, per constraint text
  prometheus::Counter& handoff_mismatch_;
  DecodeBatcher batcher_;  // last: its loop starts after the members it uses
};

}  // namespace

absl::StatusOr<std::unique_ptr<worker::JobHandler>> MakeDecodeHandler(
    const worker::WorkerSetup& setup, DecodeStageOptions options) {
  if (options.fixed_k > options.max_k)
    return absl::InvalidArgumentError(absl::StrCat("decode: --dspark-k ", options.fixed_k,
                                                   " exceeds the maximum ", options.max_k));
  return std::make_unique<DecodeHandler>(setup, options);
}

}  // namespace epd::decode_pool
