#pragma once

// The CPU backend with the seams only tests use (issue 48: they were CpuBackendOptions of the
// production backend, kernels/backend.h; no production target compiles them now). A test backend
// forwards every op to a plain kernels::MakeCpuBackend() and adds what its options ask for: device
// labels, operand checks, op counts, download bytes, a free-memory figure, the scalar kernels and
// graph recording. With no option set it gives the plain backend's results and statuses.
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kernels/backend.h"

namespace epd::testing {

struct TestCpuBackendOptions {
  // Use the SIMD (AVX2) paths where the CPU has them; false forces the scalar code on every op
  // (kernels/cpu/ops.h, ScopedScalarKernels: the same results).
  bool simd = true;
  // (tests/model/packed_weights_test.cc): memory_kind() and every Buffer say kDevice while the
  // bytes stay host memory, so a test can check that the model puts into a device backend's
  // memory what a GPU needs there, and that its results do not change.
  bool report_device_memory = false;
  // (tests/model/operand_memory_test.cc): every op fails, naming the op and the operand, unless
  // each pointer it is given starts in memory this backend allocated and has not freed (and, for
  // the paged ops, each page a listed row lies in and each page table). A forward that passes on
  // it hands a device backend only device memory; use it with report_device_memory, so the model
  // takes its device paths (the KV pool's slabs then come from a separate host backend, and the
  // host copies stage through Upload / Download). Checks start addresses only; a decoded
  // QuantWeight (host values) is not checked. Each op then takes a lock per operand.
  bool check_operands = false;
  // (tests/model/op_count_test.cc): when set, each op called directly, each Upload and Download,
  // adds one to (*op_calls)[op name]; an op given no work (no blocks, rows or entries) adds none.
  // With graphs, also "LaunchGraph", and "graph ops" (the ops launched inside graphs). Not
  // thread-safe: one thread at a time.
  std::map<std::string, int64_t>* op_calls = nullptr;
  // (tests/decode_pool/decode_stage_test.cc): when set, every Download adds its bytes. Not
  // thread-safe: one thread at a time.
  int64_t* download_bytes = nullptr;
  // (tests/model/kv_pool_test.cc): what free_memory_bytes() reports (-1: does not know,
  // as host memory).
  int64_t free_memory_bytes = -1;
  // Graphs (Backend::BeginCapture): ops between BeginCapture and EndCapture (on the capturing
  // thread) are recorded as closures over their arguments and run at each LaunchGraph, so the
  // model's decode step graphs (model/step_graph.h; docs/cuda.md, "Decode step graphs") run on
  // the CPU as on a GPU. Off: supports_graphs() is false and the model runs every step op by op
  // (the same bits; graphs save nothing on the host), as on the production CPU backend.
  bool graphs = false;
};

std::unique_ptr<kernels::Backend> MakeTestCpuBackend(TestCpuBackendOptions options = {});

}  // namespace epd::testing
