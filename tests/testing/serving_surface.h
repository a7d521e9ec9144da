#pragma once

// Everything the serving path asks of a model, on a fixed 150-token prompt: a prefill with every
// row's logits, decode steps, a multi-token verification step and its rollback, a DSpark draft,
// greedy and drawn (models with DSpark stages), the staged encoder (two chunks), decoder bounded
// replay and a batched decode step. The outputs are concatenated, so two backends (or two memory
// modes) can be compared run against run: tests/model/operand_memory_test.cc,
// tests/gpu/cuda_model_test.cc.
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model.h"
#include "model/stages.h"

namespace epd::testing {

// The concatenated outputs of one run.
struct SurfaceRun {
  std::vector<float> logits;
  std::vector<int32_t> ids;
};

inline absl::StatusOr<SurfaceRun> RunServingSurface(const model::Model& m) {
  SurfaceRun out;
  auto add = [&](const std::vector<float>& v) {
    out.logits.insert(out.logits.end(), v.begin(), v.end());
  };
  const model::ModelConfig& c = m.config();
  const int64_t V = c.vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 150; ++i) prompt.push_back(static_cast<int32_t>((i * 37 + 11) % V));
  // Monolithic: prefill (every row), decode, a multi-token verification step.
  auto st = m.NewSequence();
  auto r = m.Prefill(*st, prompt, true);
  if (!r.ok()) return r.status();
  add(r->logits);
  for (int32_t t : {3, 41, 7}) {
    r = m.Decode(*st, t % static_cast<int32_t>(V));
    if (!r.ok()) return r.status();
    add(r->logits);
  }
  const std::vector<int32_t> step = {5, 9, 13};
  auto ck = m.Checkpoint(*st, 3);
  r = m.Extend(*st, step, true);
  if (!r.ok()) return r.status();
  add(r->logits);
  const std::vector<int32_t> keep = {5, 9};
  if (absl::Status s = m.Rollback(*st, ck, keep, *r); !s.ok()) return s;
  if (c.n_mtp_layers > 0) {
    auto d = m.Draft(*st, 9);
    if (!d.ok()) return d.status();
    add(d->logits);
    add(d->confidence);
    out.ids.insert(out.ids.end(), d->ids.begin(), d->ids.end());
    // A drawn (T > 0) chain: its draws and the distributions they came from.
    model::SampleRequest sample;
    sample.params.temperature = 0.9f;
    sample.params.top_p = 0.9f;
    for (int64_t i = 0; i < c.dspark_block_size; ++i)
      sample.uniforms.push_back(0.2 + 0.6 * static_cast<double>(i) / c.dspark_block_size);
    auto s = m.Draft(*st, 9, {}, model::LogitsOut::kSample, nullptr, &sample);
    if (!s.ok()) return s.status();
    out.ids.insert(out.ids.end(), s->ids.begin(), s->ids.end());
    std::vector<float> q(static_cast<size_t>(c.dspark_block_size * V));
    if (absl::Status e = m.backend().Download(*s->q, 0, q.size() * sizeof(float), q.data());
        !e.ok())
      return e;
    add(q);
  }
  // Staged: encoder chunks, decoder bounded replay, a batched decode step.
  const int64_t tail = model::DecoderTailRows(c);
  auto sst = m.NewSequence();
  auto e1 = model::EncoderPass(m, *sst, std::span(prompt).subspan(0, 64), tail);
  if (!e1.ok()) return e1.status();
  auto e2 = model::EncoderPass(m, *sst, std::span(prompt).subspan(64), tail, &*e1);
  if (!e2.ok()) return e2.status();
  auto d = model::DecoderReplay(m, *sst, *e2);
  if (!d.ok()) return d.status();
  add(d->logits);
  model::SequenceState* batch[] = {sst.get(), st.get()};
  const std::vector<std::vector<int32_t>> toks = {{4}, {6, 8}};
  auto b = model::DecodeStep(m, batch, toks);
  if (!b.ok()) return b.status();
  for (const model::ForwardResult& f : *b) add(f.logits);
  return out;
}

}  // namespace epd::testing
