// This rank's view of the engine's tensor registry: copied into private memory, checked once.
#include "kvtd/endpoint/rank_endpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <thread>

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "endpoint_impl.h"

namespace kvtd::endpoint {

bool RankEndpoint::Impl::cache_live() const {
  // Acquire pairs with the engine's release store: the registry it wrote before is visible.
  return h->cache_state.load(std::memory_order_acquire) == static_cast<std::uint32_t>(proto::CacheState::kLive);
}

Result<bool, IpcErrc> RankEndpoint::Impl::load_tensors() {
  loaded = false;
  if (!cache_live()) {
    tensors.assign(std::size_t{geometry.num_layers} * proto::kTensorKinds, proto::TensorDesc{});
    return false;
  }
  KVTD_TRY(copy_tensors());
  loaded = true;
  return true;
}

Status<IpcErrc> RankEndpoint::Impl::copy_tensors() {
  const auto& g = geometry;
  tensors.assign(std::size_t{g.num_layers} * proto::kTensorKinds, proto::TensorDesc{});
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      const proto::TensorDesc want = proto::expected_tensor(g, groups, opts.rank, l, k);
      if (want.bytes == 0) continue;  // no tensor in this slot
      proto::TensorDesc d;
      std::memcpy(&d, &view.registry()[proto::registry_index(g, opts.rank, l, static_cast<proto::TensorKind>(k))],
                  sizeof d);
      if (!d.valid) continue;  // reported by the caller when it needs the tensor
      const std::string what = fmt::format("{} tensor of rank {} layer {}", proto::slot_name(groups, k), opts.rank, l);
      if (d.rank != opts.rank || d.layer != l || d.kind != k)
        return make_error(IpcErrc::kCorrupt, fmt::format("registry entry of the {} names rank {} layer {} kind {}",
                                                         what, d.rank, d.layer, d.kind));
      std::uint64_t end = 0;
      if (d.bytes < want.bytes || !proto::checked_add(d.offset, d.bytes, &end))
        return make_error(IpcErrc::kCorrupt,
                          fmt::format("registry entry of the {} has {} bytes at offset {}; the geometry needs {}", what,
                                      d.bytes, d.offset, want.bytes));
      d.valid = 1;
      tensors[std::size_t{l} * proto::kTensorKinds + k] = d;
    }
  return {};
}

}  // namespace kvtd::endpoint
