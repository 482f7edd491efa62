// Host-backend "device" tensors: shared-memory arenas standing in for GPU memory (the host backend,
// tests and tools; a real engine registers its CUDA tensors instead).
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "session_impl.h"

namespace kvtd::engine {

Status<IpcErrc> EngineSession::free_host_device_tensors() {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  MutexLock g(impl_->mu);
  return impl_->free_arenas();
}

Status<IpcErrc> EngineSession::Impl::free_arenas() {
  if (!registry_writable())
    return make_error(IpcErrc::kInvalidArgument,
                      "the host-backend tensors can only be freed before publish(), or after clear_caches()");
  auto* reg = view.registry();
  for (std::size_t i = 0; i < arena_tensor.size(); ++i)
    if (arena_tensor[i] != nullptr) {
      reg[i].valid = 0;
      arena_tensor[i] = nullptr;
    }
  arenas.clear();  // unmaps and unlinks each arena
  return {};
}

// Under mu throughout: the arenas, their tensor addresses and the registry change together (an
// engine thread reading host_device_tensor meanwhile used to race with this).
Status<IpcErrc> EngineSession::create_host_device_tensors() {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  MutexLock lock(impl_->mu);
  const auto& g = impl_->geo;
  if (!impl_->arenas.empty())
    KVTD_TRY(impl_->free_arenas());
  const std::uint32_t incarnation = impl_->arena_incarnation++;
  for (std::uint32_t r = 0; r < g.num_ranks; ++r) {
    if (!impl_->serves(r)) continue;  // another process's session makes that rank's arena
    // Every tensor of rank r, single shape or groups alike (slot k of each layer).
    std::vector<proto::TensorDesc> tensors;
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
        if (const auto d = proto::expected_tensor(g, impl_->groups, r, l, k); d.bytes != 0) tensors.push_back(d);
    std::uint64_t total = 0;
    for (const auto& d : tensors) total += (d.bytes + 255) / 256 * 256;
    // Named by uid and generation, not by suffix, so the name always fits the 64-byte handle
    // and a sweep can tell whose session it belonged to.
    // After a clear the new arenas get new names (incarnation * 1000 + rank; kMaxRanks < 1000), so a
    // daemon can never open a freed arena's successor by its old handle.
    const std::string arena =
        detail::session_object_name(impl_->generation, "dev" + std::to_string(incarnation * 1000 + r));
    SharedObject::remove(arena);
    KVTD_ASSIGN_OR_RETURN(auto m, SharedObject::create(arena, total));
    m->set_unlink_on_destroy(true);
    std::uint64_t offset = 0;
    for (proto::TensorDesc d : tensors) {
      d.device_id = -1;
      d.offset = offset;
      std::memcpy(d.handle, arena.c_str(), arena.size() + 1);
      KVTD_TRY(impl_->register_tensor(d));
      impl_->arena_tensor[proto::registry_index(g, r, d.layer, static_cast<proto::TensorKind>(d.kind))] =
          m->data() + offset;
      offset += (d.bytes + 255) / 256 * 256;
    }
    impl_->arenas.push_back(std::move(m));
  }
  return {};
}

std::byte* EngineSession::host_device_tensor(std::uint32_t rank, std::uint32_t layer, proto::TensorKind kind) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return nullptr;
  const auto& g = impl_->geo;
  if (rank >= g.num_ranks || layer >= g.num_layers) return nullptr;
  MutexLock lock(impl_->mu);
  return impl_->arena_tensor[proto::registry_index(g, rank, layer, kind)];
}

}  // namespace kvtd::engine
