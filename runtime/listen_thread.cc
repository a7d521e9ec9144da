#include "runtime/listen_thread.h"

#include <httplib.h>

#include <chrono>

namespace epd::runtime {

void ListenThread::Start(httplib::Server* server) {
  server_ = server;
  done_ = std::make_shared<std::atomic<bool>>(false);
  thread_ = std::thread([server, done = done_] {
    server->listen_after_bind();
    *done = true;
  });
}

void ListenThread::Stop() {
  if (!thread_.joinable()) return;
  while (!*done_) {
    server_->stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  thread_.join();
}

}  // namespace epd::runtime
