#include "kvtd/transport/leases.h"

#include <algorithm>
#include <string>

namespace kvtd::transport {

Status<TransportErrc> Leases::hold(std::uint64_t request, std::uint64_t peer, std::vector<std::int32_t> blocks,
                                   std::int64_t now) {
  if (blocks.empty())
    return make_error(TransportErrc::kInvalidArgument, "request " + std::to_string(request) + " holds no blocks");
  if (leases_.count(request) != 0)
    return make_error(TransportErrc::kInvalidArgument, "request " + std::to_string(request) + " is held already");
  leases_.emplace(request, Lease{peer, std::move(blocks), now + duration_});
  return {};
}

void Leases::heartbeat(std::uint64_t peer, std::int64_t now) {
  const std::int64_t until = now + duration_ * 2 / 3;
  for (auto& [id, l] : leases_)
    if (l.peer == peer) l.ends = std::max(l.ends, until);
}

void Leases::transfer_started(std::uint64_t request) {
  if (auto it = leases_.find(request); it != leases_.end()) ++it->second.in_flight;
}

void Leases::transfer_ended(std::uint64_t request) {
  if (auto it = leases_.find(request); it != leases_.end() && it->second.in_flight > 0) --it->second.in_flight;
}

std::vector<std::int32_t> Leases::release(std::uint64_t request) {
  const auto it = leases_.find(request);
  if (it == leases_.end()) return {};
  auto blocks = std::move(it->second.blocks);
  leases_.erase(it);
  return blocks;
}

void Leases::peer_failed(std::uint64_t peer, std::int64_t now) {
  for (auto& [id, l] : leases_)
    if (l.peer == peer) l.ends = std::min(l.ends, now);
}

std::vector<Leases::Freed> Leases::expire(std::int64_t now) {
  std::vector<Freed> out;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.ends <= now && it->second.in_flight == 0) {
      out.push_back({it->first, std::move(it->second.blocks)});
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<std::uint64_t> Leases::overdue(std::int64_t now) const {
  std::vector<std::uint64_t> out;
  for (const auto& [id, l] : leases_)
    if (l.ends <= now && l.in_flight > 0) out.push_back(id);
  return out;
}

}  // namespace kvtd::transport
