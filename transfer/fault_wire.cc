#include "transfer/fault_wire.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "spdlog/spdlog.h"

namespace epd::transfer {
namespace {

class FaultWire final : public Wire {
 public:
  FaultWire(std::unique_ptr<Wire> inner, FaultPlan plan) : inner_(std::move(inner)), plan_(plan) {}
  ~FaultWire() override { Stop(); }

  absl::Status Start(WireHandler* handler) override {
    timer_ = std::thread([this] { TimerLoop(); });
    return inner_->Start(handler);
  }

  void Stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    // Delayed operations that never went out complete with an error.
    for (auto& [when, op] : timed_) op.fn(false);
    timed_.clear();
    inner_->Stop();
  }

  TransportCapabilities Capabilities() const override { return inner_->Capabilities(); }
  bool PostsReceives() const override { return inner_->PostsReceives(); }
  void PostReceive(PeerId peer, const DataHeader& expected, uint8_t* dst, uint64_t mem) override {
    inner_->PostReceive(peer, expected, dst, mem);
  }
  void CancelReceives(PeerId peer, uint64_t receiver_transfer_id) override {
    inner_->CancelReceives(peer, receiver_transfer_id);
  }
  void DiscardChunks(PeerId peer, std::vector<DataHeader> chunks) override {
    inner_->DiscardChunks(peer, std::move(chunks));
  }
  std::string LocalAddress() const override { return inner_->LocalAddress(); }
  absl::StatusOr<PeerId> Connect(absl::string_view address, absl::Duration timeout) override {
    return inner_->Connect(address, timeout);
  }
  TransportKind PeerKind(PeerId peer) const override { return inner_->PeerKind(peer); }

  void SendControl(PeerId peer, std::string bytes, Done done) override {
    if (!Hit(FaultPlan::Target::kControl)) {
      inner_->SendControl(peer, std::move(bytes), std::move(done));
      return;
    }
    switch (plan_.action) {
      case FaultPlan::Action::kDrop:
        spdlog::info("fault: dropping a control message");
        Later(peer, absl::ZeroDuration(), [done](bool) { done(absl::OkStatus()); });
        return;
      case FaultPlan::Action::kDelay:
        Later(peer, plan_.delay, [this, peer, bytes = std::move(bytes), done](bool run) mutable {
          if (run) {
            inner_->SendControl(peer, std::move(bytes), done);
          } else {
            done(absl::CancelledError("wire stopped"));
          }
        });
        return;
      case FaultPlan::Action::kDisconnect:
        Disconnect(peer, std::move(done));
        return;
      default:  // truncate/corrupt of control: corrupt the encoding
        if (!bytes.empty()) bytes.resize(bytes.size() / 2);
        inner_->SendControl(peer, std::move(bytes), std::move(done));
        return;
    }
  }

  void SendData(PeerId peer, const DataHeader& header, const uint8_t* data, uint64_t wire_length,
                uint64_t mem, Done done) override {
    if (!Hit(FaultPlan::Target::kData)) {
      inner_->SendData(peer, header, data, wire_length, mem, std::move(done));
      return;
    }
    switch (plan_.action) {
      case FaultPlan::Action::kDrop:
        spdlog::info("fault: dropping data chunk (segment {}, offset {})", header.segment,
                     header.offset);
        Later(peer, absl::ZeroDuration(), [done](bool) { done(absl::OkStatus()); });
        return;
      case FaultPlan::Action::kDelay:
        Later(peer, plan_.delay, [this, peer, header, data, wire_length, mem, done](bool run) {
          if (run) {
            inner_->SendData(peer, header, data, wire_length, mem, done);
          } else {
            done(absl::CancelledError("wire stopped"));
          }
        });
        return;
      case FaultPlan::Action::kTruncate:
        inner_->SendData(peer, header, data,
                         wire_length - std::min(wire_length, plan_.truncate_bytes), mem,
                         std::move(done));
        return;
      case FaultPlan::Action::kCorrupt: {
        // Never touch the sender's copy: send a corrupted duplicate, freed on completion.
        auto copy = std::make_shared<std::vector<uint8_t>>(data, data + wire_length);
        if (!copy->empty())
          (*copy)[std::min<uint64_t>(plan_.corrupt_offset, copy->size() - 1)] ^= 0x5a;
        inner_->SendData(peer, header, copy->data(), wire_length, 0,
                         [copy, done](absl::Status st) { done(st); });
        return;
      }
      case FaultPlan::Action::kDisconnect:
        Disconnect(peer, std::move(done));
        return;
      case FaultPlan::Action::kNone:
        inner_->SendData(peer, header, data, wire_length, mem, std::move(done));
        return;
    }
  }

  void ClosePeer(PeerId peer, absl::Status why, bool peer_dead = false) override {
    {
      // Operations parked here for this peer never reach the inner wire: they end now, with an
      // error, on the timer thread (so the memory they reference is provably unused).
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<Parked> cancelled;
      for (auto it = timed_.begin(); it != timed_.end();) {
        if (it->second.peer == peer) {
          it->second.cancelled = true;
          cancelled.push_back(std::move(it->second));
          it = timed_.erase(it);
        } else {
          ++it;
        }
      }
      const auto now = std::chrono::steady_clock::now();
      for (auto& op : cancelled) timed_.emplace(now, std::move(op));
      cv_.notify_all();
    }
    inner_->ClosePeer(peer, why, peer_dead);
  }
  absl::StatusOr<uint64_t> Register(void* addr, uint64_t length) override {
    return inner_->Register(addr, length);
  }
  void Deregister(uint64_t handle) override { inner_->Deregister(handle); }

 private:
  bool Hit(FaultPlan::Target target) {
    if (plan_.action == FaultPlan::Action::kNone || plan_.target != target) return false;
    const int n = (target == FaultPlan::Target::kData ? data_seen_ : control_seen_).fetch_add(1);
    return plan_.nth < 0 || n == plan_.nth;
  }

  void Disconnect(PeerId peer, Done done) {
    spdlog::info("fault: disconnecting peer {}", peer);
    inner_->ClosePeer(peer, absl::UnavailableError("fault injection: disconnect"));
    Later(peer, absl::ZeroDuration(),
          [done](bool) { done(absl::UnavailableError("fault injection: disconnect")); });
  }

  // Runs fn(true) on the timer thread after `delay`, or fn(false) at Stop.
  void Later(PeerId peer, absl::Duration delay, std::function<void(bool)> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    auto when = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(delay);
    if (plan_.spaced && delay > absl::ZeroDuration()) {
      when = std::max(when, last_when_ + absl::ToChronoNanoseconds(delay));
      last_when_ = when;
    }
    if (stopped_) {
      std::thread([fn] { fn(false); }).detach();
      return;
    }
    timed_.emplace(when, Parked{peer, std::move(fn), false});
    cv_.notify_all();
  }

  void TimerLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopped_) {
      if (timed_.empty()) {
        cv_.wait(lock);
        continue;
      }
      auto first = timed_.begin();
      const auto when = first->first;  // a copy: ClosePeer may erase the entry while we wait
      if (std::chrono::steady_clock::now() < when) {
        cv_.wait_until(lock, when);
        continue;
      }
      Parked op = std::move(first->second);
      timed_.erase(first);
      lock.unlock();
      op.fn(!op.cancelled);
      lock.lock();
    }
  }

  std::unique_ptr<Wire> inner_;
  FaultPlan plan_;
  std::atomic<int> data_seen_{0};
  std::atomic<int> control_seen_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  struct Parked {
    PeerId peer = 0;
    std::function<void(bool)> fn;  // fn(true): go on; fn(false): complete with an error
    bool cancelled = false;
  };
  std::multimap<std::chrono::steady_clock::time_point, Parked> timed_;
  bool stopped_ = false;
  std::chrono::steady_clock::time_point last_when_{};
  std::thread timer_;
};

}  // namespace

std::unique_ptr<Wire> MakeFaultWire(std::unique_ptr<Wire> inner, FaultPlan plan) {
  return std::make_unique<FaultWire>(std::move(inner), plan);
}

}  // namespace epd::transfer
