#include "device_tensors.h"

#include "kvtd/proto/pci.h"

#include <cstdio>
#include <cstring>

#ifdef KVTD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kvtd::loadgen {

std::unique_ptr<DeviceTensors> DeviceTensors::create(engine::EngineSession& s, bool cuda, std::string* why) {
  std::unique_ptr<DeviceTensors> t(new DeviceTensors);
  t->s_ = &s;
  t->cuda_ = cuda;
  if (!cuda) {
    if (auto st = s.create_host_device_tensors(); !st.ok()) {
      *why = st.error().message;
      return nullptr;
    }
    return t;
  }
#ifndef KVTD_HAVE_CUDA
  *why = "--device-tensors cuda: this kvtd-loadgen was built without CUDA";
  return nullptr;
#else
  const auto& g = s.geometry();
  const std::size_t slots = std::size_t{g.num_ranks} * g.num_layers * proto::kTensorKinds;
  t->device_.assign(slots, nullptr);
  t->mirror_.resize(slots);
  for (std::uint32_t r = 0; r < g.num_ranks; ++r) {
    std::uint64_t total = 0;
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
        total += (proto::expected_tensor(g, s.groups(), r, l, k).bytes + 255) / 256 * 256;
    void* arena = nullptr;
    cudaIpcMemHandle_t h{};
    if (auto e = cudaMalloc(&arena, total); e != cudaSuccess) {
      *why = std::string("cudaMalloc: ") + cudaGetErrorString(e);
      return nullptr;
    }
    t->arenas_.push_back(arena);
    if (auto e = cudaIpcGetMemHandle(&h, arena); e != cudaSuccess) {
      *why = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(e);
      return nullptr;
    }
    char bus[32] = {0};
    int device = 0;
    (void)cudaGetDevice(&device);
    (void)cudaDeviceGetPCIBusId(bus, sizeof bus, device);
    std::uint64_t offset = 0;
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const auto kind = static_cast<proto::TensorKind>(k);
        proto::TensorDesc d = proto::expected_tensor(g, s.groups(), r, l, k);  // slot k of a group session
        if (d.bytes == 0) continue;
        d.device_id = device;
        d.pci_bus_id = proto::parse_pci_bus_id(bus).value_or(0);
        d.offset = offset;
        std::memcpy(d.handle, &h, sizeof h);
        if (auto st = s.register_tensor(d); !st.ok()) {
          *why = st.error().message;
          return nullptr;
        }
        const std::size_t i = proto::registry_index(g, r, l, kind);
        t->device_[i] = static_cast<std::byte*>(arena) + offset;
        t->mirror_[i].assign(d.bytes, std::byte{0});
        offset += (d.bytes + 255) / 256 * 256;
      }
  }
  (void)cudaGetLastError();
  return t;
#endif
}

DeviceTensors::~DeviceTensors() {
#ifdef KVTD_HAVE_CUDA
  for (void* a : arenas_) (void)cudaFree(a);
#endif
}

std::byte* DeviceTensors::view(std::uint32_t rank, std::uint32_t layer, proto::TensorKind kind) const {
  if (!cuda_) return s_->host_device_tensor(rank, layer, kind);
  const auto& g = s_->geometry();
  auto& m = mirror_[proto::registry_index(g, rank, layer, kind)];
  return m.empty() ? nullptr : const_cast<std::byte*>(m.data());
}

bool DeviceTensors::push() {
#ifdef KVTD_HAVE_CUDA
  for (std::size_t i = 0; cuda_ && i < device_.size(); ++i)
    if (device_[i] != nullptr)
      if (auto e = cudaMemcpy(device_[i], mirror_[i].data(), mirror_[i].size(), cudaMemcpyHostToDevice); e != cudaSuccess) {
        std::fprintf(stderr, "kvtd-loadgen: cudaMemcpy to the device: %s\n", cudaGetErrorString(e));
        return false;
      }
#endif
  return true;
}

bool DeviceTensors::pull() {
#ifdef KVTD_HAVE_CUDA
  for (std::size_t i = 0; cuda_ && i < device_.size(); ++i)
    if (device_[i] != nullptr)
      if (auto e = cudaMemcpy(mirror_[i].data(), device_[i], mirror_[i].size(), cudaMemcpyDeviceToHost); e != cudaSuccess) {
        std::fprintf(stderr, "kvtd-loadgen: cudaMemcpy from the device: %s\n", cudaGetErrorString(e));
        return false;
      }
#endif
  return true;
}

}  // namespace kvtd::loadgen
