// cache_mapping.h (daemon-internal) - mapping the engine's KV tensors of this rank: from the
// engine's registry, or by FastDeploy's names (the tensors its worker published, or the cache
// this daemon makes for it with --create_cache_tensor), each paired with its host-pool region.
#pragma once

#include <atomic>
#include <cstdint>
#include <fmt/format.h>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/attached_cache.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "fastdeploy_ipc.h"

namespace kvtd::daemon {

// Whether the engine registered no tensor of this rank: then FastDeploy's worker published them
// by name (fastdeploy_ipc.h). A registry with some tensors but not all is the engine's error,
// reported by attach_cache naming the first one missing.
bool registered_none(const endpoint::RankEndpoint& ep);

// With FastDeploy's flags, waits until FastDeploy's worker says its KV cache exists
// (cache_ready_signal.<port>[rank] == 1), as FastDeploy's own transfer manager does. The heartbeat
// runs meanwhile. False when asked to stop or the engine went away.
bool wait_for_fastdeploy_cache(const config::DaemonConfig& cfg, const endpoint::RankEndpoint& ep,
                               const std::atomic<bool>& stop);

// A tensor that names a process's own memory (/proc/<pid>/fd/<fd>, the host backend) must name
// the engine's: the process the session says made it (`engine_pid`, the engine's word) and that
// maps the session (`maps_session(pid)`, which the daemon sees for itself). A daemon running with
// more rights than its engine must not map another process's memory for it. The reason when it
// does not, else none.
std::optional<std::string> foreign_process_memory(const proto::TensorDesc& d, std::uint32_t engine_pid,
                                                  bool engine_in_our_pid_namespace,
                                                  const std::function<bool(std::uint32_t)>& maps_session);

// Where this rank's tensors come from: the engine's registry; or, when the engine registered
// none, FastDeploy's names. Borrows everything it is given; one mapping pass at a time.
class TensorSource {
 public:
  TensorSource(endpoint::RankEndpoint& ep, TensorMapper& backend, std::int32_t device_id, bool by_names,
               const FastDeployOwnedCache* owned)
      : ep_(ep), backend_(backend), device_id_(device_id), owned_(owned), by_names_(by_names) {}

  // The device address of the tensor's first byte.
  Result<std::byte*, DeviceErrc> open(std::uint32_t l, proto::TensorKind kind) {
    if (by_names_ && proto::is_group_session(ep_.groups()))
      return make_error(DeviceErrc::kOpenFailed, "the engine registered no tensors of this rank (a session with cache "
                                                 "groups registers them all; FastDeploy's names are single-shape)");
    if (by_names_ && owned_ != nullptr) return owned_->tensor(l, kind);
    const proto::TensorDesc* d = ep_.tensor(l, kind);
    proto::TensorDesc named{};
    if (by_names_) {
      KVTD_ASSIGN_OR_RETURN(named, read_fastdeploy_tensor(ep_.geometry(), ep_.rank(), l, kind, device_id_));
      d = &named;
    }
    if (!d)
      return make_error(DeviceErrc::kOpenFailed,
                        fmt::format("{} tensor of layer {} is not registered", proto::tensor_kind_name(kind), l));
    const auto maps_session = [this](std::uint32_t pid) { return ep_.mapped_by(pid); };
    if (auto why = foreign_process_memory(*d, ep_.engine_pid(), ep_.engine_in_our_pid_namespace(), maps_session))
      return make_error(DeviceErrc::kOpenFailed, *why);
    return backend_.open_tensor(*d);
  }

  std::string describe(std::size_t tensors) const {
    if (!by_names_) return "";
    const auto example = fastdeploy_tensor_name(proto::TensorKind::kKey, 0, ep_.rank(), device_id_);
    return owned_ != nullptr ? fmt::format("made the {} tensors of this rank's cache and published them by "
                                           "FastDeploy's names for its worker (e.g. {})",
                                           tensors, example)
                             : fmt::format("the engine registered no tensors: opened the {} tensors FastDeploy's "
                                           "worker published by name (e.g. {})",
                                           tensors, example);
  }

 private:
  endpoint::RankEndpoint& ep_;
  TensorMapper& backend_;
  std::int32_t device_id_;
  const FastDeployOwnedCache* owned_;
  bool by_names_;
};

// Maps every tensor of this rank and pairs it with its host-pool region: one group of every layer
// for a single-shape geometry (`gs` all zero, pools[0]), else one per cache group (pools[g]).
Result<AttachedCache, DeviceErrc> attach_cache(const proto::CacheGeometry& g, const proto::CacheGroups& gs,
                                               TensorSource& source, const HostPools& pools);

// FastDeploy's --create_cache_tensor: makes this rank's cache, publishes it by FastDeploy's names
// and tells FastDeploy's worker (cache_ready_signal[rank] = 1), as its transfer manager does.
Result<std::unique_ptr<FastDeployOwnedCache>, DeviceErrc> make_fastdeploy_cache(const config::DaemonConfig& cfg,
                                                                               const endpoint::RankEndpoint& ep,
                                                                               TensorMapper& backend);

}  // namespace kvtd::daemon
