// The tensor registry: validation of each tensor an engine registers.
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

#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "session_impl.h"

namespace kvtd::engine {

Status<IpcErrc> EngineSession::Impl::register_tensor(const proto::TensorDesc& d) {
  if (!registry_writable())
    return make_error(IpcErrc::kInvalidArgument,
                      "tensors can only be registered before publish(), or while clear_caches() has every rank's "
                      "mappings released");
  if (d.rank >= geo.num_ranks || d.layer >= geo.num_layers || d.kind >= proto::kTensorKinds)
    return make_error(IpcErrc::kInvalidArgument, "tensor rank " + std::to_string(d.rank) + " layer " +
                                                     std::to_string(d.layer) + " kind " + std::to_string(d.kind) +
                                                     " is outside the geometry");
  if (!serves(d.rank))
    return make_error(IpcErrc::kInvalidArgument, "tensor of rank " + std::to_string(d.rank) +
                                                     ": this session serves " + detail::ranks_text(served) + " only");
  const proto::TensorDesc want = proto::expected_tensor(geo, groups, d.rank, d.layer, d.kind);
  const std::string what = proto::slot_name(groups, d.kind) + " tensor";
  if (want.bytes == 0)
    return make_error(IpcErrc::kInvalidArgument, proto::is_group_session(groups)
                                                     ? "layer " + std::to_string(d.layer) + " has no " + what + " in its groups"
                                                     : "the geometry has no " + what);
  // proto::geometry_problem bounded this size below 2^56 at create().
  const std::uint64_t need = want.bytes;
  std::uint64_t end = 0;
  if (!proto::checked_add(d.offset, d.bytes, &end))
    return make_error(IpcErrc::kInvalidArgument, "tensor offset " + std::to_string(d.offset) + " plus " +
                                                     std::to_string(d.bytes) + " bytes overflows");
  if (d.bytes < need)
    return make_error(IpcErrc::kInvalidArgument, what + " of layer " + std::to_string(d.layer) + " has " +
                                                     std::to_string(d.bytes) + " bytes, the geometry needs " +
                                                     std::to_string(need));
  // No device has 2^48 bytes (256 TiB): a size or offset beyond it is a caller's bug (a negative
  // number through an unsigned type), not a tensor.
  constexpr std::uint64_t kMaxTensorEnd = std::uint64_t{1} << 48;
  if (end > kMaxTensorEnd)
    return make_error(IpcErrc::kInvalidArgument, what + " of layer " + std::to_string(d.layer) + ": offset " + std::to_string(d.offset) +
                                                     " plus " + std::to_string(d.bytes) +
                                                     " bytes is beyond any device (2^48 bytes)");
  auto& slot = view.registry()[proto::registry_index(geo, d.rank, d.layer, static_cast<proto::TensorKind>(d.kind))];
  slot = d;
  slot.valid = 1;
  return {};
}

}  // namespace kvtd::engine
