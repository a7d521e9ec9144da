#pragma once

// An in-process Wire for unit tests: wires attached to one LoopbackNetwork reach each other by
// name ("loopback:<name>"). Every wire has its own delivery thread, so callbacks never run inside
// a Wire call, as with UCX. Data is copied straight into the receiver's sink.
#include <memory>
#include <string>

#include "transfer/wire.h"

namespace epd::transfer {

class LoopbackNetwork;

// Wires of one test share one network (thread-safe, lives as long as any wire using it).
std::shared_ptr<LoopbackNetwork> MakeLoopbackNetwork();
std::unique_ptr<Wire> MakeLoopbackWire(std::shared_ptr<LoopbackNetwork> network,
                                       const std::string& name);

}  // namespace epd::transfer
