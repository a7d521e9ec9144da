// The KV pool's slabs registered with a real UCX transfer engine (runtime/worker/
// pool_registration.h): each slab once, as the pool allocates it; given back on trim and at the
// end. A pool block goes to another engine straight from its registered slab (KvTransport::Borrow:
// no staging copy, no per-transfer registration) and arrives byte for byte; the other engine
// receives it into a fresh pool block of its own, registered the same way.
#include "runtime/worker/pool_registration.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "kernels/format.h"
#include "model/kv_pool.h"
#include "prometheus/registry.h"
#include "tests/testing/test_cpu_backend.h"
#include "transfer/manifest.h"
#include "transfer/transfer_engine.h"
#include "transfer/ucx_wire.h"

namespace epd::worker {
namespace {

namespace kf = kernels::format;
using model::KvPool;
using model::KvRowFormat;
using model::KvRows;

std::vector<float> KeyRows(int64_t n, int64_t dim, int salt) {
  std::vector<float> v(n * dim);
  for (int64_t i = 0; i < n * dim; ++i)
    v[i] = static_cast<float>(((i * 5 + salt * 17) % 21) - 10) * 0.5f;
  for (int64_t r = 0; r < n; ++r) kf::Fp4IndexQuantDequantRow(v.data() + r * dim, dim);
  return v;
}

class PoolRegistrationTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    transfer::UcxOptions uo;
    uo.mode = GetParam() == "tcp" ? transfer::UcxOptions::Mode::kListener
                                  : transfer::UcxOptions::Mode::kWorkerAddress;
    uo.net_devices = "lo";
    transfer::EngineOptions o;
    o.config_fingerprint = "fp";
    o.cluster_token = "tok";
    o.release_grace = absl::Milliseconds(200);
    auto rx = transfer::TransferEngine::Create(transfer::MakeUcxWire(uo), o, registry_,
                                               common::SystemClock::Get());
    ASSERT_TRUE(rx.ok()) << rx.status();
    rx_ = std::move(*rx);
    auto tx = transfer::TransferEngine::Create(transfer::MakeUcxWire(uo), o, registry_,
                                               common::SystemClock::Get());
    ASSERT_TRUE(tx.ok()) << tx.status();
    tx_ = std::move(*tx);
    auto peer = tx_->Connect(rx_->LocalAddress(), absl::Seconds(10));
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  // Waits until `t` holds exactly `registrations` and nothing else (transfers released).
  static void ExpectSettled(transfer::KvTransport& t, int64_t registrations) {
    transfer::ResourceCounts c;
    for (int i = 0; i < 600; ++i) {
      c = t.Resources();
      if (c.registrations == registrations && c.live_transfers == 0 && c.wire_ops == 0 &&
          c.allocations == 0)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(c.registrations, registrations);
    EXPECT_EQ(c.live_transfers, 0);
    EXPECT_EQ(c.wire_ops, 0);
    EXPECT_EQ(c.allocations, 0);
  }

  prometheus::Registry registry_;
  std::unique_ptr<transfer::TransferEngine> rx_, tx_;
  transfer::PeerId peer_ = 0;
};

TEST_P(PoolRegistrationTest, SlabsRegisteredOnceAndBlocksSentFromThem) {
  const int64_t dim = 128;
  const int64_t block = 32 * kf::PackedIndexKeyBytes(dim);
  auto tx_pool = std::make_shared<KvPool>(0, 0, nullptr, 4 * block);
  auto rx_pool = std::make_shared<KvPool>(0, 0, nullptr, 4 * block);
  // A slab the pool had before the registration is registered too.
  auto keys = std::make_shared<KvRows>(tx_pool, KvRowFormat::kPackedKey, dim, 2, 1);
  const std::vector<float> x = KeyRows(32 * 6, dim, 1);
  ASSERT_TRUE(keys->Append(x.data(), 32).ok());
  auto tx_reg = std::make_unique<PoolRegistration>(tx_pool, *tx_);
  PoolRegistration rx_reg(rx_pool, *rx_);
  EXPECT_EQ(tx_reg->registered_slabs(), 1);
  EXPECT_EQ(tx_->Resources().registrations, 1);
  // Growing past the first slab registers the next one, once.
  ASSERT_TRUE(keys->Append(x.data() + 32 * dim, 32 * 5).ok());  // 6 blocks: 2 slabs
  EXPECT_EQ(tx_pool->stats().slabs, 2);
  EXPECT_EQ(tx_reg->registered_slabs(), 2);
  EXPECT_EQ(tx_reg->failures(), 0);
  EXPECT_EQ(tx_->Resources().registrations, 2);

  // Each sealed block goes over UCX from where it lies: the payload is the block itself.
  for (size_t bi : {size_t{0}, size_t{5}}) {
    SCOPED_TRACE(bi);
    const KvPool::Block b = keys->blocks()[bi];
    ASSERT_NE(tx_reg->HandleFor(b.data, block), 0u);
    const std::string rid = "pool-block-" + std::to_string(bi);
    epd::v1::Manifest m;
    m.set_request_id(rid);
    m.set_config_fingerprint("fp");
    transfer::AddRawBytesSegment(m, epd::v1::SEGMENT_BLOCK, -1, 0, 0, block);
    // The receiver lands it in a fresh block of its own pool (registered slab: no per-transfer
    // registration on that side either).
    KvRows landed(rx_pool, KvRowFormat::kPackedKey, dim, 2, 1);
    std::vector<float> zeros(31 * dim, 0.f);
    ASSERT_TRUE(landed.Append(zeros.data(), 31).ok());  // a writable, unsealed block
    const KvPool::Block dst = landed.blocks()[0];
    auto into = rx_->Borrow(dst.data, block, nullptr);
    ASSERT_TRUE(into.ok()) << into.status();
    auto rid_id = rx_->Receive(m, std::move(*into), {});
    ASSERT_TRUE(rid_id.ok()) << rid_id.status();
    EXPECT_EQ(rx_->Resources().registrations, rx_reg.registered_slabs());
    auto payload = tx_->Borrow(b.data, block, keys);  // keeps the blocks referenced
    ASSERT_TRUE(payload.ok()) << payload.status();
    auto sid = tx_->Send(peer_, m, std::move(*payload), {});
    ASSERT_TRUE(sid.ok()) << sid.status();
    // No registration of its own: the slab's serves.
    EXPECT_EQ(tx_->Resources().registrations, 2);
    ASSERT_TRUE(rx_->Wait(*rid_id, absl::Seconds(30)).ok()) << rx_->Status(*rid_id)->error;
    ASSERT_TRUE(tx_->Wait(*sid, absl::Seconds(30)).ok()) << tx_->Status(*sid)->error;
    auto got = rx_->TakeReceived(*rid_id);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->buffer->data(), dst.data);  // received in place, into the pool block
    got->buffer.reset();
    tx_->Forget(*sid);
    EXPECT_EQ(0, std::memcmp(dst.data, b.data, block));
    std::vector<float> want(x.begin() + bi * 32 * dim, x.begin() + (bi + 1) * 32 * dim);
    std::vector<float> row(32 * dim);
    landed.Unpack(0, 32, row.data());  // the 32nd row was not appended: read the block whole
    EXPECT_EQ(std::vector<float>(row.begin(), row.begin() + 31 * dim),
              std::vector<float>(want.begin(), want.begin() + 31 * dim));
    ExpectSettled(*tx_, 2);
    ExpectSettled(*rx_, rx_reg.registered_slabs());
  }

  // Slabs the pool gives back are deregistered; the rest go with the registration.
  keys.reset();
  tx_pool->SetCapacity(1);  // evicts the cached sealed blocks
  tx_pool->SetCapacity(0);
  EXPECT_EQ(tx_pool->Trim(), 2 * 4 * block);
  EXPECT_EQ(tx_reg->registered_slabs(), 0);
  EXPECT_EQ(tx_->Resources().registrations, 0);
  KvRows again(tx_pool, KvRowFormat::kPackedKey, dim, 2, 1);
  ASSERT_TRUE(again.Append(x.data(), 3).ok());
  EXPECT_EQ(tx_->Resources().registrations, 1);
  tx_reg.reset();
  EXPECT_EQ(tx_->Resources().registrations, 0);
}

// A pool in a device backend's memory (a CPU backend labelled as one): its slabs are not handed
// to the wire (no CUDA transport), nor counted as failures.
TEST_P(PoolRegistrationTest, DeviceSlabsAreNotRegistered) {
  auto device = testing::MakeTestCpuBackend({.report_device_memory = true});
  const int64_t dim = 128;
  auto pool = std::make_shared<KvPool>(0, 0, device.get(), 4 * 32 * kf::PackedIndexKeyBytes(dim));
  PoolRegistration reg(pool, *tx_);
  KvRows keys(pool, KvRowFormat::kPackedKey, dim, 2, 1);
  const std::vector<float> x = KeyRows(32 * 5, dim, 2);
  ASSERT_TRUE(keys.Append(x.data(), 32 * 5).ok());
  EXPECT_EQ(pool->stats().slabs, 2);
  EXPECT_EQ(reg.device_slabs(), 2);
  EXPECT_EQ(reg.registered_slabs(), 0);
  EXPECT_EQ(reg.failures(), 0);
  EXPECT_EQ(tx_->Resources().registrations, 0);
  EXPECT_EQ(keys.ToVector(), x);
}

INSTANTIATE_TEST_SUITE_P(Ucx, PoolRegistrationTest, ::testing::Values("tcp", "shm"));

}  // namespace
}  // namespace epd::worker
