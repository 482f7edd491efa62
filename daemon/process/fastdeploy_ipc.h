// fastdeploy_ipc.h - FastDeploy's shared-memory names, read and written as FastDeploy's own
// processes do, so its GPU worker and engine need no change to work with kvtd.
//
// 1. KV tensors by name. FastDeploy's GPU worker publishes each cache tensor with its custom op
//    `set_data_ipc` (custom_ops/gpu_ops/set_data_ipc.cu): a POSIX shared-memory object holding
//    `struct shmStruct { size_t nprocesses; cudaIpcMemHandle_t memHandle; }`
//    (custom_ops/gpu_ops/cuda_multiprocess.h: 8 + 64 bytes on x86-64), named
//    `key_caches_<layer>_rank<rank>.device<device_id>` (value_caches_, key_cache_scales_,
//    value_cache_scales_: worker/gpu_model_runner.py initialize_kv_cache, and
//    cache_manager/cache_transfer_manager.py _init_gpu_cache). The handle is taken of the tensor's
//    data pointer and opened at offset 0 (share_external_data.cu), so kvtd opens it at offset 0.
//    On the host backend the 64 handle bytes hold a shared-memory object name instead, exactly
//    as in kvtd's own registry.
// 2. IPCSignals (fastdeploy/inter_communicator/ipc_signal.py): a numpy array in a POSIX
//    shared-memory object `<name>.<suffix>`, the suffix being --engine_worker_queue_port.
//
// Everything read from these objects is hostile input: sizes are checked against the object
// before reading, and the bytes are copied into private memory once.
// Thread-safety: free functions are reentrant; a FastDeploySignal is used by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvtd/daemon/device_backend.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::daemon {

// sizeof(shmStruct) in FastDeploy's cuda_multiprocess.h on LP64: size_t, then the 64-byte handle.
inline constexpr std::size_t kFastDeployShmStructBytes = 8 + proto::kHandleBytes;
inline constexpr std::size_t kFastDeployHandleOffset = 8;

// The name FastDeploy's worker publishes `kind` of `layer` under.
std::string fastdeploy_tensor_name(proto::TensorKind kind, std::uint32_t layer, std::uint32_t rank,
                                   std::int32_t device_id);

// The descriptor of one tensor published by FastDeploy's worker: the geometry's shape and size,
// the handle bytes copied out of the object, offset 0. kOpenFailed names the object when it is
// missing, too small or unreadable.
Result<proto::TensorDesc, DeviceErrc> read_fastdeploy_tensor(const proto::CacheGeometry& g, std::uint32_t rank,
                                                            std::uint32_t layer, proto::TensorKind kind,
                                                            std::int32_t device_id);

// FastDeploy's --create_cache_tensor (cache_transfer_manager.py _init_gpu_cache, used when
// FastDeploy runs with a storage backend): the transfer manager allocates its rank's KV cache
// (every layer, the extra MTP layers too, zero-filled), publishes each tensor under FastDeploy's
// name with set_data_ipc's struct, and sets cache_ready_signal[rank] = 1; FastDeploy's worker
// then maps them by name (worker/gpu_model_runner.py: share_external_data). This object is that
// cache. Ownership: it owns the memory (through the backend) and the names; destruction unlinks
// the names and frees the memory, after which the worker's mappings must be gone (FastDeploy's
// worker releases them before a weight update, and the adapter waits for that). Not copyable.
class FastDeployOwnedCache {
 public:
  // Allocates through `backend` and publishes every name. `object_name(i)` names the i-th
  // host-backend object (ignored by CUDA).
  static Result<std::unique_ptr<FastDeployOwnedCache>, DeviceErrc> create(
      TensorMapper& backend, const proto::CacheGeometry& g, std::uint32_t rank, std::int32_t device_id,
      const std::function<std::string(std::size_t)>& object_name);
  ~FastDeployOwnedCache();
  FastDeployOwnedCache(const FastDeployOwnedCache&) = delete;
  FastDeployOwnedCache& operator=(const FastDeployOwnedCache&) = delete;

  // The tensor's first byte in this process, or null if the geometry has none of that kind.
  std::byte* tensor(std::uint32_t layer, proto::TensorKind kind) const;

 private:
  explicit FastDeployOwnedCache(TensorMapper& backend) : backend_(backend) {}
  TensorMapper& backend_;
  std::vector<std::string> names_;  // published set_data_ipc objects
  std::vector<std::byte*> tensors_;  // layer * kTensorKinds + kind
};

// One int32 IPCSignal of FastDeploy, mapped read-write. Not copyable; movable (a moved-from one
// maps nothing).
class FastDeploySignal {
 public:
  // Opens `<name>.<suffix>`, which must hold at least `min_elements` int32 values. The message
  // names the object and its size when it cannot be used.
  static Result<FastDeploySignal, DeviceErrc> open(const std::string& name, const std::string& suffix,
                                                   std::size_t min_elements);
  FastDeploySignal(FastDeploySignal&& o) noexcept;
  FastDeploySignal& operator=(FastDeploySignal&& o) noexcept;
  FastDeploySignal(const FastDeploySignal&) = delete;
  ~FastDeploySignal();

  std::int32_t load(std::size_t i) const;
  void store(std::size_t i, std::int32_t v);
  const std::string& name() const { return name_; }

 private:
  FastDeploySignal(std::string name, void* base, std::size_t bytes) : name_(std::move(name)), base_(base), bytes_(bytes) {}
  std::string name_;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace kvtd::daemon
