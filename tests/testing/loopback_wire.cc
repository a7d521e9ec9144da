#include "tests/testing/loopback_wire.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace epd::transfer {

class LoopbackWireImpl;

class LoopbackNetwork {
 public:
  struct Link {
    LoopbackWireImpl* a = nullptr;
    PeerId a_peer = 0;
    LoopbackWireImpl* b = nullptr;
    PeerId b_peer = 0;
    bool up = true;
  };
  std::mutex mu;
  std::map<std::string, LoopbackWireImpl*> wires;
  std::map<uint64_t, std::shared_ptr<Link>> links;  // by link id
  uint64_t next_peer = 1;
};

std::shared_ptr<LoopbackNetwork> MakeLoopbackNetwork() {
  return std::make_shared<LoopbackNetwork>();
}

class LoopbackWireImpl final : public Wire {
 public:
  LoopbackWireImpl(std::shared_ptr<LoopbackNetwork> net, std::string name)
      : net_(std::move(net)), name_(std::move(name)) {}
  ~LoopbackWireImpl() override { Stop(); }

  absl::Status Start(WireHandler* handler) override {
    std::lock_guard<std::mutex> lock(net_->mu);
    if (net_->wires.contains(name_))
      return absl::AlreadyExistsError(absl::StrCat("loopback name taken: ", name_));
    handler_ = handler;
    net_->wires[name_] = this;
    running_ = true;
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  void Stop() override {
    std::vector<std::shared_ptr<LoopbackNetwork::Link>> mine;
    {
      std::lock_guard<std::mutex> lock(net_->mu);
      if (!running_) return;
      net_->wires.erase(name_);
      for (auto& [id, link] : net_->links)
        if (link->up && (link->a == this || link->b == this)) mine.push_back(link);
    }
    for (auto& link : mine) CloseLink(link, absl::UnavailableError("peer wire stopped"));
    // Deliveries already queued at peers read our memory; they see the link down and skip the
    // copy, but wait until none is mid-copy before our buffers can go.
    for (int i = 0; i < 5000 && outbound_inflight_.load() > 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(net_->mu);
    running_ = false;
  }

  TransportCapabilities Capabilities() const override {
    TransportCapabilities c;
    c.name = "loopback";
    c.zero_copy_receive = true;
    c.shared_memory = true;
    return c;
  }
  std::string LocalAddress() const override { return "loopback:" + name_; }

  absl::StatusOr<PeerId> Connect(absl::string_view address, absl::Duration) override {
    if (!absl::StartsWith(address, "loopback:"))
      return absl::InvalidArgumentError(absl::StrCat("not a loopback address: ", address));
    std::lock_guard<std::mutex> lock(net_->mu);
    auto it = net_->wires.find(std::string(address.substr(9)));
    if (it == net_->wires.end())
      return absl::UnavailableError(absl::StrCat("no loopback wire at ", address));
    auto link = std::make_shared<LoopbackNetwork::Link>();
    link->a = this;
    link->a_peer = net_->next_peer++;
    link->b = it->second;
    link->b_peer = net_->next_peer++;
    net_->links[link->a_peer] = link;
    net_->links[link->b_peer] = link;
    return link->a_peer;
  }

  TransportKind PeerKind(PeerId) const override { return TransportKind::kLoopback; }

  void SendControl(PeerId peer, std::string bytes, Done done) override {
    auto [link, target, target_peer] = Resolve(peer);
    if (!link || !target->Post([target = target, target_peer = target_peer, link = link,
                                bytes = std::move(bytes)]() mutable {
          if (link->up) target->handler_->OnControl(target_peer, std::move(bytes));
        })) {
      Post([done] { done(absl::UnavailableError("loopback peer is gone")); });
      return;
    }
    Post([done] { done(absl::OkStatus()); });
  }

  void SendData(PeerId peer, const DataHeader& header, const uint8_t* data, uint64_t wire_length,
                uint64_t, Done done) override {
    auto [link, target, target_peer] = Resolve(peer);
    if (!link) {
      Post([done] { done(absl::UnavailableError("loopback peer is gone")); });
      return;
    }
    outbound_inflight_.fetch_add(1);
    const bool posted = target->Post([this, link = link, target = target, target_peer = target_peer,
                                      header, data, wire_length, done] {
      absl::Status st = absl::OkStatus();
      if (!link->up) {
        st = absl::UnavailableError("loopback link closed");
      } else {
        DataSink sink = target->handler_->OnDataBegin(target_peer, header, wire_length);
        if (sink.dst == nullptr) {
          st = absl::AbortedError("chunk refused by the receiver");
        } else {
          std::memcpy(sink.dst, data, wire_length);
          target->handler_->OnDataEnd(target_peer, header, wire_length, absl::OkStatus());
        }
      }
      if (!Post([done, st] { done(st); })) done(st);
      outbound_inflight_.fetch_sub(1);
    });
    if (!posted) {
      outbound_inflight_.fetch_sub(1);
      Post([done] { done(absl::UnavailableError("loopback peer is gone")); });
    }
  }

  void ClosePeer(PeerId peer, absl::Status why, bool = false) override {
    std::shared_ptr<LoopbackNetwork::Link> link;
    {
      std::lock_guard<std::mutex> lock(net_->mu);
      auto it = net_->links.find(peer);
      if (it == net_->links.end() || !it->second->up) return;
      link = it->second;
    }
    CloseLink(link, why);
  }

  absl::StatusOr<uint64_t> Register(void*, uint64_t) override {
    std::lock_guard<std::mutex> lock(mu_);
    return next_mem_++;
  }
  void Deregister(uint64_t) override {}

  bool Post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !draining_) return false;
    tasks_.push_back(std::move(fn));
    cv_.notify_all();
    return true;
  }

 private:
  std::tuple<std::shared_ptr<LoopbackNetwork::Link>, LoopbackWireImpl*, PeerId> Resolve(
      PeerId peer) {
    std::lock_guard<std::mutex> lock(net_->mu);
    auto it = net_->links.find(peer);
    if (it == net_->links.end() || !it->second->up) return {nullptr, nullptr, 0};
    auto& link = it->second;
    if (link->a == this && link->a_peer == peer) return {link, link->b, link->b_peer};
    return {link, link->a, link->a_peer};
  }

  void CloseLink(const std::shared_ptr<LoopbackNetwork::Link>& link, absl::Status why) {
    {
      std::lock_guard<std::mutex> lock(net_->mu);
      if (!link->up) return;
      link->up = false;
    }
    LoopbackWireImpl* a = link->a;
    LoopbackWireImpl* b = link->b;
    const PeerId ap = link->a_peer;
    const PeerId bp = link->b_peer;
    const bool a_local = a == this;
    auto local = a_local ? a : b;
    auto remote = a_local ? b : a;
    const PeerId lp = a_local ? ap : bp;
    const PeerId rp = a_local ? bp : ap;
    local->Post([local, lp, why] { local->handler_->OnPeerDown(lp, why); });
    remote->Post([remote, rp, why] {
      remote->handler_->OnPeerDown(
          rp, absl::UnavailableError(absl::StrCat("connection closed by peer: ", why.message())));
    });
  }

  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty() && stopping_) break;
      if (stopping_) draining_ = true;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
    draining_ = false;
  }

  std::shared_ptr<LoopbackNetwork> net_;
  std::string name_;
  WireHandler* handler_ = nullptr;
  bool running_ = false;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool draining_ = false;
  uint64_t next_mem_ = 1;
  std::atomic<int> outbound_inflight_{0};
};

std::unique_ptr<Wire> MakeLoopbackWire(std::shared_ptr<LoopbackNetwork> network,
                                       const std::string& name) {
  return std::make_unique<LoopbackWireImpl>(std::move(network), name);
}

}  // namespace epd::transfer
