#pragma once

// The accept loop of a bound cpp-httplib server, on a thread of its own, stoppable at any moment.
#include <atomic>
#include <memory>
#include <thread>

namespace httplib {
class Server;
}

namespace epd::runtime {

// Runs server->listen_after_bind() on its own thread. httplib 0.11's stop() does nothing until
// the loop has started (it checks is_running()), so a stop right after the start (a SIGTERM during
// startup) used to leave the loop running and the join hung; Stop() repeats stop() until the loop
// has provably returned. The server must have been set up with ConfigureListener (http_util.h):
// its 50 ms idle interval makes a loop that started after the last stop() see the closed socket.
class ListenThread {
 public:
  ListenThread() = default;
  ~ListenThread() { Stop(); }
  ListenThread(const ListenThread&) = delete;
  ListenThread& operator=(const ListenThread&) = delete;

  void Start(httplib::Server* server);
  // Returns once the accept loop has ended; idempotent, and a no-op before Start.
  void Stop();

 private:
  httplib::Server* server_ = nullptr;
  std::thread thread_;
  std::shared_ptr<std::atomic<bool>> done_;
};

}  // namespace epd::runtime
