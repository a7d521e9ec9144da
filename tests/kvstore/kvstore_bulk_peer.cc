// kvstore_bulk_peer: a kvstore client process for the bulk-path tests. Puts one value of --bytes
// bytes (Payload(--seed)) under Key(--key) over UCX, each data chunk held --chunk-delay-ms on the
// way out (a slow link), so a test can SIGKILL this process in the middle of the transfer.
// Prints "put ok" or "put failed: <why>" and exits 0/1. With --get it gets Key(--key) over UCX
// instead (prints "get ok <bytes>" / "get failed: <why>"). With --batch-loop N it gets
// Key(--key) .. Key(--key + N - 1) as one BatchGet through shared memory, over and over, printing
// "batching" after the first good batch (and exits 1 on a wrong byte), until it is killed.
#include <CLI/CLI.hpp>
#include <iostream>
#include <string>
#include <vector>

#include "kvstore/kvstore_client.h"
#include "transfer/fault_wire.h"
#include "tests/kvstore/test_util.h"

int main(int argc, char** argv) {
  CLI::App app{"kvstore_bulk_peer"};
  std::string target;
  int key = 0, chunk_delay_ms = 0;
  uint64_t bytes = 0, seed = 0;
  app.add_option("--target", target)->required();
  app.add_option("--key", key)->required();
  app.add_option("--bytes", bytes)->required();
  app.add_option("--seed", seed)->required();
  app.add_option("--chunk-delay-ms", chunk_delay_ms);
  bool get = false;
  app.add_flag("--get", get);
  int batch_loop = 0;
  app.add_option("--batch-loop", batch_loop);
  CLI11_PARSE(app, argc, argv);

  if (batch_loop > 0) {
    epd::kvstore::KvClientOptions so;
    so.deadline_ms = 60000;
    auto client = epd::kvstore::KvStoreClient::Create(target, so);
    std::vector<std::string> keys;
    for (int i = 0; i < batch_loop; ++i)
      keys.emplace_back(epd::kvstore::AsBytes(epd::kvstore::testing::Key(key + i)));
    for (bool first = true;; first = false) {
      auto r = client->BatchGet(epd::kvstore::Tier::kAuto, keys, false);
      if (!r.ok()) {
        std::cout << "batch failed: " << r.status() << std::endl;
        return 1;
      }
      for (int i = 0; i < batch_loop; ++i) {
        const auto& item = (*r)[static_cast<size_t>(i)];
        if (!item.ok() || !item->found ||
            item->value != epd::kvstore::testing::Payload(seed + static_cast<uint64_t>(i), bytes)) {
          std::cout << "batch wrong at " << i << std::endl;
          return 1;
        }
      }
      if (first) {
        std::cout << (client->shared_memory_active() ? "batching shm" : "batching inline")
                  << std::endl;
      }
    }
  }

  epd::kvstore::KvClientOptions o;
  o.bulk = epd::kvstore::BulkTransport::kUcx;
  o.bulk_min_bytes = 0;
  o.deadline_ms = 60000;
  if (chunk_delay_ms > 0) {
    epd::transfer::FaultPlan plan;
    plan.action = epd::transfer::FaultPlan::Action::kDelay;
    plan.target = epd::transfer::FaultPlan::Target::kData;
    plan.nth = -1;
    plan.spaced = true;
    plan.delay = absl::Milliseconds(chunk_delay_ms);
    o.debug_wrap_wire = [plan](std::unique_ptr<epd::transfer::Wire> inner) {
      return epd::transfer::MakeFaultWire(std::move(inner), plan);
    };
  }
  auto client = epd::kvstore::KvStoreClient::Create(target, o);
  if (get) {
    std::cout << "getting" << std::endl;
    auto g = client->Get(epd::kvstore::Tier::kG3,
                         epd::kvstore::AsBytes(epd::kvstore::testing::Key(key)));
    if (!g.ok()) {
      std::cout << "get failed: " << g.status() << std::endl;
      return 1;
    }
    std::cout << "get ok " << g->value.size() << std::endl;
    return 0;
  }
  const std::string value = epd::kvstore::testing::Payload(seed, bytes);
  const auto k = epd::kvstore::testing::Key(key);
  std::cout << "putting" << std::endl;
  absl::Status s = client->Put(epd::kvstore::Tier::kG3, epd::kvstore::AsBytes(k), value);
  if (!s.ok()) {
    std::cout << "put failed: " << s << std::endl;
    return 1;
  }
  std::cout << "put ok" << std::endl;
  return 0;
}
