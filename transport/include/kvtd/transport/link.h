// kvtd/transport/link.h - one daemon's UCX worker: its endpoints to peer daemons, the blocks it
// sends them, and the blocks it lets them write (grants).
//
// Two-sided by design: no peer ever holds a remote key to this daemon's memory. A block comes as
// a UCX active message whose header (block_header.h) names a grant and a block index; this side
// looks the grant up and receives the bytes into that block (zero-copy for large blocks: the
// receive pulls them through UCX's rendezvous), or drops them. So a peer writes only into blocks
// granted to it, only once each, only before the grant expires, and a peer that sends anything
// else costs only its own message (a rejected rendezvous send completes with an error on its
// side). Grant ids are capabilities: make them unguessable (random 64 bits) and hand them to the
// peer over an authenticated channel. Every block is checked against the checksum its source
// took before it is reported received; a mismatch fails that block, named.
//
// Memory: host memory is received into and sent from in place. Whether the UCX found at start
// can reach CUDA memory is reported (cuda_memory()); Debian's UCX cannot, and then device blocks
// go through pinned host staging (the caller's).
//
// Thread-safety: none. One thread owns a Link and makes every call, progress() included;
// completions are reported by progress() on that thread. Not copyable or movable (UCX holds
// pointers to it). Destruction cancels what is in flight and closes every endpoint, bounded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtd/proto/expected.h"
#include "kvtd/transport/transport_errc.h"

namespace kvtd::transport {

struct LinkOptions {
  // Blocks of at least this many bytes go zero-copy (rendezvous), smaller ones by copy (eager).
  std::size_t rndv_bytes = 8192;
  // CLOCK_MONOTONIC nanoseconds by default; tests pass their own to expire grants.
  std::function<std::int64_t()> now_ns;
};

struct LinkEvent {
  enum class Kind {
    kSent,            // a send completed: the peer has the bytes (id: the send)
    kSendFailed,      // a send failed or the peer rejected it (id: the send)
    kReceived,        // a granted block arrived whole and its checksum matched (id: grant, index)
    kReceiveFailed,   // a granted block's receive failed or its checksum did not match: its bytes are
                      // not usable (id: grant, index)
    kRejected,        // a message for no live grant, a block outside it or one already received:
                      // nothing written (id: grant, index as the peer named them)
    kPeerFailed,      // the endpoint to a peer failed (id: the peer); connect() again
  };
  Kind kind;
  std::uint64_t id = 0;
  std::uint32_t index = 0;
  TransportErrc code = TransportErrc::kInternal;  // for the failures
  std::string message;                            // for the failures: what, naming grant/block/peer
};

class Link {
 public:
  // A UCX context and worker with the active-message feature; kUnavailable if UCX cannot start.
  static Result<std::unique_ptr<Link>, TransportErrc> open(LinkOptions options = {});
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // This worker's address, for peers to connect() to (valid as long as the Link).
  std::span<const std::byte> address() const;
  // Whether UCX registers CUDA memory directly (a CUDA-enabled UCX), else device blocks need
  // host staging; and that in words, for the log.
  bool cuda_memory() const;
  std::string memory_path() const;

  // An endpoint to the peer whose worker address is `peer_address`; returns its peer id.
  Result<std::uint64_t, TransportErrc> connect(std::span<const std::byte> peer_address);
  // Closes the endpoint; its sends in flight fail.
  void disconnect(std::uint64_t peer);

  // Lets peers write `blocks` (this process's memory, each one block) under `grant` until
  // `expires_ns` (now_ns's clock). kInvalidArgument for a grant id in use, 0, or no blocks.
  Status<TransportErrc> grant(std::uint64_t grant, std::vector<std::span<std::byte>> blocks, std::int64_t expires_ns);
  // Ends `grant`: no block is accepted for it any more, and receives into it in flight are
  // cancelled and waited for (up to 5 s), so when revoke returns ok nothing more is written into
  // its blocks. kUnavailable if some are still in flight then: the blocks may still be written
  // and must not be reused until receives_in_flight() says none is left (the grant goes when the
  // last one ends). Unknown grants are ignored.
  Status<TransportErrc> revoke(std::uint64_t grant);
  // Receives in flight into blocks of any grant, revoked ones included.
  std::size_t receives_in_flight() const;
  // Blocks of `grant` received and verified so far (0 for an unknown grant).
  std::size_t received(std::uint64_t grant) const;

  // Sends `src` as block `index` of the peer's `grant`, its checksum taken now. `src` must stay
  // unchanged until the send is reported (kSent / kSendFailed): a rendezvous send is read when the
  // peer pulls it, and bytes changed before then fail the peer's checksum. Returns the send's id.
  Result<std::uint64_t, TransportErrc> send_block(std::uint64_t peer, std::uint64_t grant, std::uint32_t index,
                                                  std::span<const std::byte> src);
  std::size_t sends_in_flight() const;

  // Drives UCX until it has nothing more to do now; appends what completed to `events`.
  void progress(std::vector<LinkEvent>& events);

 private:
  struct Impl;
  explicit Link(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::transport
