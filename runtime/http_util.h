#pragma once

// cpp-httplib helpers shared by every epd HTTP listener.
#include <httplib.h>
#include <sys/socket.h>

namespace epd::runtime {

// httplib's default socket options add SO_REUSEPORT, which lets a second process bind the same
// port and silently take half the traffic. epd listeners bind exclusively (SO_REUSEADDR only),
// so a busy port is a clear startup error.
inline void UseExclusiveBind(httplib::Server& server) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });
}

// The options every epd listener gets before it binds: exclusive bind, and an accept loop that
// wakes every 50 ms (ListenThread::Stop, listen_thread.h, relies on it).
inline void ConfigureListener(httplib::Server& server) {
  UseExclusiveBind(server);
  server.set_idle_interval(0, 50'000);
}

}  // namespace epd::runtime
