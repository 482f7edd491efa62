// kvtd/transport/leases.h - the prefill side's hold on a request's KV blocks until its decode peer
// has them: released when the decode side confirms, or freed when the lease ends. A lease starts
// at `duration`; each heartbeat from the peer extends every lease held for it to at least
// now + 2/3 duration (vLLM's NIXL lease, docs/design/nixl_kv_cache_lease.md: a short first
// lease, heartbeats while the request waits on the decode side, so a decode that died frees the
// blocks within a lease and an overloaded one keeps them). A lease whose end has passed while a
// transfer of it is in flight is overdue, not expired: its owner cancels the transfer first, so
// no block is freed (and reused) while it is being read.
//
// Thread-safety: none (a value; its owner serialises calls). Copyable and movable.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "kvtd/proto/expected.h"
#include "kvtd/transport/transport_errc.h"

namespace kvtd::transport {

class Leases {
 public:
  struct Freed {
    std::uint64_t request;
    std::vector<std::int32_t> blocks;
  };

  // `duration_ns` > 0: a lease's first length; heartbeats extend by two thirds of it.
  explicit Leases(std::int64_t duration_ns) : duration_(duration_ns) {}

  // Holds `blocks` for `request` (for decode peer `peer`) until now + duration. kInvalidArgument
  // for a request held already or no blocks.
  Status<TransportErrc> hold(std::uint64_t request, std::uint64_t peer, std::vector<std::int32_t> blocks,
                             std::int64_t now);
  // The peer is alive and still wants its requests: each of its leases lasts at least until
  // now + 2/3 duration.
  void heartbeat(std::uint64_t peer, std::int64_t now);
  // A transfer of the request's blocks began / ended (a lease with one in flight never expires).
  void transfer_started(std::uint64_t request);
  void transfer_ended(std::uint64_t request);
  // The decode side has the blocks: the request's blocks to free now (empty if not held).
  std::vector<std::int32_t> release(std::uint64_t request);
  // The peer is gone (its endpoint failed, its daemon died): its leases end now.
  void peer_failed(std::uint64_t peer, std::int64_t now);
  // Leases past their end with no transfer in flight: removed, their blocks to free.
  std::vector<Freed> expire(std::int64_t now);
  // Requests past their lease's end with transfers still in flight: cancel those transfers.
  std::vector<std::uint64_t> overdue(std::int64_t now) const;
  std::size_t held() const { return leases_.size(); }

 private:
  struct Lease {
    std::uint64_t peer;
    std::vector<std::int32_t> blocks;
    std::int64_t ends;
    std::uint32_t in_flight = 0;
  };
  std::int64_t duration_;
  std::map<std::uint64_t, Lease> leases_;
};

}  // namespace kvtd::transport
