// AdmissionQueue (services/router/admission.h): running slots, a bounded FIFO queue, refusals
// at once beyond it, the queue-wait limit, and its gauges/counter.
#include "services/router/admission.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <thread>

#include <gtest/gtest.h>

#include "prometheus/registry.h"
#include "services/router/router_core.h"

namespace epd::services::router {
namespace {

void WaitUntil(const std::function<bool()>& pred) {
  while (!pred()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

double CounterValue(prometheus::Registry& reg, const std::string& name, const std::string& api) {
  for (const auto& fam : reg.Collect()) {
    if (fam.name != name) continue;
    for (const auto& m : fam.metric) {
      for (const auto& l : m.label) {
        if (l.name == "api" && l.value == api) return m.counter.value;
      }
    }
  }
  return -1;
}

TEST(AdmissionQueueTest, RefusesAtOnceBeyondRunningPlusQueuedAndHandsSlotsOverInOrder) {
  prometheus::Registry reg;
  AdmissionQueue q({.max_running = 1, .max_queued = 2}, reg);
  auto first = q.Admit("http");
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(q.running(), 1);

  std::atomic<int> order{0};
  std::atomic<int> a_rank{0}, b_rank{0};
  std::optional<AdmissionQueue::Ticket> a_ticket, b_ticket;
  std::thread a([&] {
    auto t = q.Admit("http");
    ASSERT_TRUE(t.ok());
    a_rank = ++order;
    a_ticket.emplace(std::move(*t));
  });
  WaitUntil([&] { return q.queued() == 1; });
  std::thread b([&] {
    auto t = q.Admit("grpc");
    ASSERT_TRUE(t.ok());
    b_rank = ++order;
    b_ticket.emplace(std::move(*t));
  });
  WaitUntil([&] { return q.queued() == 2; });

  // Full: refused at once, with the OpenAI code and a counted refusal.
  auto refused = q.Admit("grpc");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrorCode(refused.status()), "overloaded");
  EXPECT_EQ(CounterValue(reg, "epd_router_overload_rejections_total", "grpc"), 1);
  EXPECT_EQ(CounterValue(reg, "epd_router_overload_rejections_total", "http"), 0);

  *first = AdmissionQueue::Ticket();  // releases the slot: the oldest waiter (a) takes it
  a.join();
  EXPECT_EQ(a_rank, 1);
  EXPECT_EQ(b_rank, 0);
  EXPECT_EQ(q.running(), 1);
  EXPECT_EQ(q.queued(), 1);
  a_ticket.reset();
  b.join();
  EXPECT_EQ(b_rank, 2);
  b_ticket.reset();
  EXPECT_EQ(q.running(), 0);
  EXPECT_EQ(q.queued(), 0);
}

TEST(AdmissionQueueTest, NoQueueMeansRefusedWhileAllSlotsRun) {
  prometheus::Registry reg;
  AdmissionQueue q({.max_running = 2, .max_queued = 0}, reg);
  auto a = q.Admit("http");
  auto b = q.Admit("http");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(q.Admit("http").status().code(), absl::StatusCode::kResourceExhausted);
  { AdmissionQueue::Ticket drop = std::move(*a); }
  EXPECT_TRUE(q.Admit("http").ok());  // admitted, and released again at once
  EXPECT_EQ(q.running(), 1);
}

TEST(AdmissionQueueTest, QueuedRequestGivesUpAfterTheWaitLimit) {
  prometheus::Registry reg;
  AdmissionQueue q({.max_running = 1, .max_queued = 1, .max_queue_wait_ms = 20}, reg);
  auto held = q.Admit("http");
  ASSERT_TRUE(held.ok());
  auto waited = q.Admit("http");
  ASSERT_FALSE(waited.ok());
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(waited.status().message().find("waited 20 ms"), std::string::npos);
  EXPECT_EQ(q.queued(), 0);
  EXPECT_EQ(q.running(), 1);
}

TEST(AdmissionQueueTest, OptionsAreValidated) {
  EXPECT_TRUE(AdmissionOptions{}.Validate().ok());
  EXPECT_FALSE(AdmissionOptions{.max_running = 0}.Validate().ok());
  EXPECT_FALSE(AdmissionOptions{.max_queued = -1}.Validate().ok());
  EXPECT_FALSE(AdmissionOptions{.retry_after_s = 0}.Validate().ok());
}

}  // namespace
}  // namespace epd::services::router
