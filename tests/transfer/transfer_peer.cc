// transfer_peer: one side of a KV hand-off in its own process, for the UCX integration tests.
//
//   recv: starts a UCX transport, writes its address to --address-file, receives one hand-off
//         (the manifest it derives itself from --workload), checks checksums + bytes, and writes
//         a JSON result (ok, error, resources after release) to --result-file.
//   send: connects to --connect (or the address read from --address-file) and sends one hand-off.
// Exit status: 0 ok, 1 transfer failed (result file says why), 2 setup failed.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <thread>

#include "CLI/CLI.hpp"
#include "transfer/fault_wire.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_wire.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "spdlog/spdlog.h"
#include "tests/transfer/transfer_testing.h"
#include "tests/testing/handoff_layout.h"

namespace et = epd::transfer;

int main(int argc, char** argv) {
  CLI::App app{"transfer_peer"};
  std::string role, mode = "shm", address_file, connect, result_file, workload = "nano";
  std::string request_id = "req", fingerprint = "fp", token = "tok", ip = "127.0.0.1";
  std::string tls, net_devices;
  int prompt = 1000, bulk_segments = 16, noise = 5, delay_ms = 0, deadline_ms = 20000;
  int chunk_kib = 4096;
  uint64_t bulk_mib = 256, seed = 42;
  app.add_option("--role", role)->required()->check(CLI::IsMember({"send", "recv"}));
  app.add_option("--mode", mode)->check(CLI::IsMember({"tcp", "shm"}));
  app.add_option("--address-file", address_file);
  app.add_option("--connect", connect);
  app.add_option("--result-file", result_file);
  app.add_option("--workload", workload)->check(CLI::IsMember({"nano", "bulk"}));
  app.add_option("--request-id", request_id);
  app.add_option("--fingerprint", fingerprint);
  app.add_option("--token", token);
  app.add_option("--ip", ip);
  app.add_option("--tls", tls);
  app.add_option("--net-devices", net_devices);
  app.add_option("--prompt", prompt);
  app.add_option("--bulk-mib", bulk_mib);
  app.add_option("--bulk-segments", bulk_segments);
  app.add_option("--noise-slots", noise, "sender: DSpark block size it claims (5 is right)");
  app.add_option("--delay-data-ms", delay_ms, "sender: delay every data chunk (slow transfer)");
  app.add_option("--chunk-kib", chunk_kib);
  app.add_option("--deadline-ms", deadline_ms);
  app.add_option("--seed", seed);
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(std::getenv("EPD_DEBUG") ? spdlog::level::debug : spdlog::level::info);

  et::UcxOptions uo;
  uo.mode = mode == "tcp" ? et::UcxOptions::Mode::kListener : et::UcxOptions::Mode::kWorkerAddress;
  uo.listen_ip = ip;
  uo.tls = tls;
  uo.net_devices = net_devices;
  et::EngineOptions eo;
  eo.config_fingerprint = fingerprint;
  eo.cluster_token = token;
  eo.node_name = "transfer_peer-" + role;
  eo.chunk_bytes = static_cast<uint64_t>(chunk_kib) << 10;
  prometheus::Registry registry;
  std::unique_ptr<et::Wire> wire = et::MakeUcxWire(uo);
  if (delay_ms > 0) {
    et::FaultPlan plan;
    plan.action = et::FaultPlan::Action::kDelay;
    plan.nth = -1;
    plan.delay = absl::Milliseconds(delay_ms);
    plan.spaced = true;
    wire = et::MakeFaultWire(std::move(wire), plan);
  }
  auto engine =
      et::TransferEngine::Create(std::move(wire), eo, registry, epd::common::SystemClock::Get());
  if (!engine.ok()) {
    std::cerr << "setup: " << engine.status() << "\n";
    return 2;
  }
  et::KvTransport& t = **engine;

  epd::testing::HandoffLayout layout = epd::testing::NanoTestLayout(epd::testing::HandoffKind::kPrefillToDecode);
  epd::v1::Manifest manifest;
  if (workload == "nano") {
    if (role == "send") layout.dspark_block_size = noise;
    manifest = *epd::testing::BuildExpectedManifest(
        layout, et::testing::NanoRequest(request_id, fingerprint, prompt));
  } else {
    manifest = et::testing::BulkManifest(request_id, fingerprint, bulk_segments,
                                         (bulk_mib << 20) / bulk_segments);
  }
  et::TransferOptions opts;
  opts.deadline = absl::Milliseconds(deadline_ms);
  opts.lease = absl::Milliseconds(deadline_ms);

  nlohmann::json result;
  absl::Status st;
  if (role == "recv") {
    auto buf = t.Allocate(et::TotalBytes(manifest));
    auto id = t.Receive(manifest, std::move(*buf), opts);
    if (!id.ok()) {
      std::cerr << "receive: " << id.status() << "\n";
      return 2;
    }
    if (!address_file.empty()) {
      std::ofstream tmp(address_file + ".tmp");
      tmp << t.LocalAddress();
      tmp.close();
      std::rename((address_file + ".tmp").c_str(), address_file.c_str());
    }
    std::cout << "READY " << t.LocalAddress().substr(0, 40) << std::endl;
    st = t.Wait(*id, opts.deadline + absl::Seconds(5));
    if (st.ok()) {
      const auto status = t.Status(*id);
      result["transport"] =
          status.ok() ? std::string(et::TransportLabel(status->transport)) : "unknown";
      auto got = t.TakeReceived(*id);
      const std::string diff = et::testing::ComparePayload(manifest, got->buffer->data(), seed);
      result["byte_compare"] = diff.empty() ? "identical" : diff;
      if (!diff.empty()) st = absl::DataLossError(diff);
      result["bytes"] = got->buffer->size();
    }
    t.Forget(*id);
  } else {
    if (connect.empty() && !address_file.empty()) {
      for (int i = 0; i < 1000 && connect.empty(); ++i) {
        std::ifstream in(address_file);
        std::getline(in, connect);
        if (connect.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    auto peer = t.Connect(connect, absl::Seconds(10));
    if (!peer.ok()) {
      result["ok"] = false;
      result["error"] = std::string(peer.status().ToString());
      std::cerr << "connect: " << peer.status() << "\n";
      if (!result_file.empty()) std::ofstream(result_file) << result.dump();
      return 1;
    }
    auto buf = t.Allocate(et::TotalBytes(manifest));
    et::testing::FillPayload(manifest, (*buf)->data(), seed);
    std::cout << "SENDING" << std::endl;
    auto id = t.Send(*peer, manifest, std::move(*buf), opts);
    st = id.ok() ? t.Wait(*id, opts.deadline + absl::Seconds(5)) : id.status();
    if (id.ok()) t.Forget(*id);
  }
  // Everything must be released once the transfer has ended (allow the grace period).
  et::ResourceCounts c = t.Resources();
  for (int i = 0; i < 400 && (c.registrations || c.allocations || c.live_transfers || c.wire_ops);
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    c = t.Resources();
  }
  result["ok"] = st.ok();
  result["error"] = std::string(st.message());
  result["code"] = static_cast<int>(st.code());
  result["registrations"] = c.registrations;
  result["allocations"] = c.allocations;
  result["live_transfers"] = c.live_transfers;
  result["wire_ops"] = c.wire_ops;
  std::cout << "RESULT " << result.dump() << std::endl;
  if (!result_file.empty()) std::ofstream(result_file) << result.dump();
  engine->reset();
  return st.ok() ? 0 : 1;
}
