// device_tensors.h - where kvtd-loadgen's "device" KV tensors live. Host: the session's
// shared-memory arenas (daemons run --device-backend host). CUDA: device memory, one cudaMalloc
// per rank with the tensors at offsets in it, registered by IPC handle plus offset (daemons run
// --device-backend cuda; on a GPU, or in the CUDA stand-in build). The loadgen reads and writes
// host views: the arenas themselves, or mirrors that push() and pull() copy to and from the GPU.
//
// Ownership: owns the device memory and mirrors; the session must outlive it. Not copyable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvtd/engine/engine_session.h"

namespace kvtd::loadgen {

class DeviceTensors {
 public:
  // Registers every tensor of the session's geometry (before publish). Null and `why` on failure.
  static std::unique_ptr<DeviceTensors> create(engine::EngineSession& s, bool cuda, std::string* why);
  ~DeviceTensors();
  DeviceTensors(const DeviceTensors&) = delete;
  DeviceTensors& operator=(const DeviceTensors&) = delete;

  std::byte* view(std::uint32_t rank, std::uint32_t layer, proto::TensorKind kind) const;
  bool push();  // host views -> device (CUDA); false naming the error on stderr
  bool pull();  // device -> host views (CUDA)

 private:
  DeviceTensors() = default;
  engine::EngineSession* s_ = nullptr;
  bool cuda_ = false;
  std::vector<void*> arenas_;          // CUDA: one allocation per rank
  std::vector<std::byte*> device_;     // by registry index: the tensor in device memory
  std::vector<std::vector<std::byte>> mirror_;  // by registry index: its host view
};

}  // namespace kvtd::loadgen
