#pragma once

// A schedule of batched decode steps whose row counts come and go (sequences joining and
// leaving, multi-token steps), for the decode step graphs (model/step_graph.h): each row count
// runs op by op on its first step, is recorded on its second and launched after. The outputs are
// concatenated so that two runs (graphs on and off, two backends) compare bit for bit:
// tests/model/step_graph_test.cc (CPU, graphs recorded as closures), tests/gpu/cuda_model_test.cc.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/stages.h"

namespace epd::testing {

// Which sequences a step takes and how many tokens each (0: not in the step).
using Schedule = std::vector<std::vector<int>>;

// Row counts 3 (five steps: op by op, recorded, launched x 3), 4 (a multi-token step, three
// times), 1 (one sequence alone, three times), then 3 again.
inline Schedule DefaultStepSchedule() {
  Schedule s;
  for (int i = 0; i < 5; ++i) s.push_back({1, 1, 1});
  for (int i = 0; i < 3; ++i) s.push_back({2, 0, 2});
  for (int i = 0; i < 3; ++i) s.push_back({0, 0, 1});
  for (int i = 0; i < 2; ++i) s.push_back({1, 1, 1});
  return s;
}

struct StepsRun {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
  model::StepGraphStats stats;
  std::vector<std::map<std::string, int64_t>> calls;  // per step (with op_calls)
  int layers = 0;
};

// Runs `schedule` on three sequences of `model` (prompts of `prompts` tokens). `calls`
// (optional: the backend's TestCpuBackendOptions::op_calls) is cleared before each step and kept
// per step in StepsRun::calls.
inline StepsRun RunStepSchedule(const model::Model& model, const Schedule& schedule,
                                std::map<std::string, int64_t>* calls = nullptr,
                                std::vector<int> prompts = {40, 63, 86}) {
  StepsRun run;
  run.layers = model.config().n_layers;
  const int64_t V = model.config().vocab_size;
  std::vector<std::unique_ptr<model::SequenceState>> seqs;
  for (int b = 0; b < 3; ++b) {
    seqs.push_back(model.NewSequence());
    std::vector<int32_t> prompt(prompts.at(b));
    for (size_t i = 0; i < prompt.size(); ++i)
      prompt[i] = static_cast<int32_t>((3 + i * 7 + b) % V);
    auto r = model.Prefill(*seqs.back(), prompt, false);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
  }
  for (size_t step = 0; step < schedule.size(); ++step) {
    std::vector<model::SequenceState*> states;
    std::vector<std::vector<int32_t>> tokens;
    std::vector<model::LogitsRequest> outs;
    for (int b = 0; b < 3; ++b) {
      std::vector<int32_t> t;
      for (int i = 0; i < schedule[step][b]; ++i)
        t.push_back(static_cast<int32_t>((step * 7 + b * 13 + i * 5 + 1) % V));
      if (t.empty()) continue;
      // A multi-token step that would run row by row takes its first token only.
      if (t.size() > 1 && !model.Batchable(*seqs[b], t)) t.erase(t.begin() + 1, t.end());
      states.push_back(seqs[b].get());
      tokens.push_back(t);
      // Sequence 0 takes its greedy tokens from the backend, the others their logits rows.
      outs.emplace_back(b == 0 ? model::LogitsOut::kArgmax : model::LogitsOut::kValues);
    }
    if (calls != nullptr) calls->clear();
    std::vector<absl::Status> failed;
    auto r = model::DecodeStep(model, states, tokens, &failed, outs);
    EXPECT_TRUE(r.ok()) << "step " << step << ": " << r.status();
    if (!r.ok()) return run;
    for (size_t i = 0; i < r->size(); ++i) {
      EXPECT_TRUE(failed[i].ok()) << "step " << step << " sequence " << i << ": " << failed[i];
      const model::ForwardResult& fr = (*r)[i];
      run.logits.insert(run.logits.end(), fr.logits.begin(), fr.logits.end());
      run.tokens.insert(run.tokens.end(), fr.tokens.begin(), fr.tokens.end());
    }
    if (calls != nullptr) run.calls.push_back(*calls);
  }
  run.stats = model.step_graph_stats();
  return run;
}

}  // namespace epd::testing
