// endpoint_impl.h (daemon/endpoint internal) - RankEndpoint's private state, shared by
// rank_endpoint.cpp (attach, the ring, completions, progress), agreement.cpp (the cross-rank MIN
// of storage tasks) and registry_view.cpp (this rank's view of the engine's tensor registry).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/rings.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/ipc/shared_object.h"

namespace kvtd::endpoint {

using namespace kvtd::ipc;  // NOLINT(google-build-using-namespace): the contract this end implements

struct RankEndpoint::Impl {
  // The state over a published segment whose header copy passed validation.
  static std::unique_ptr<Impl> over(const EndpointOptions& o, std::unique_ptr<SharedObject> m,
                                    const detail::HeaderCopy& header, const detail::SessionLayout& layout);

  // Reads peer r's agreement word of task `seq`: folds its count into *agreed and clears r from
  // *pending_mask when it is there; an abort, a reused slot or a peer declared dead ends the
  // agreement with that status; otherwise (not written yet) nothing changes.
  Status<proto::TaskStatus> read_peer(std::uint32_t r, std::uint64_t seq, std::uint32_t want_tag,
                                      std::uint32_t peer_epoch, std::uint32_t* agreed, std::uint32_t* pending_mask);

  EndpointOptions opts;
  std::unique_ptr<SharedObject> mapping;
  detail::SessionView view;           // from the validated header: never re-read
  proto::CacheGeometry geometry{};    // private copy
  proto::CacheGroups groups{};        // private copy (num_groups 0: a single-shape session)
  std::uint64_t generation = 0;       // private copy
  std::uint32_t engine_pid = 0;       // private copy (SessionHeader::creator_pid)
  // The engine runs in this daemon's pid namespace (SessionHeader::engine_pid_namespace): only then
  // does engine_pid, or a /proc/<pid> path it registered, name it here.
  bool engine_in_our_pid_namespace = false;
  // This daemon's lock on the rank's byte of the segment (ipc/liveness_lock.h): taken before the
  // claim, held while attached, so the engine and any newcomer see in every pid namespace that
  // this rank's daemon lives (or, silent, is stopped rather than dead).
  ipc::LivenessLock rank_lock;
  bool take_over_host_tier = false;  // private copy (proto::SessionHeader)
  // The ranks that agree on storage tasks: the session's served ranks (every rank by default).
  std::uint32_t agreeing_ranks = 0;
  proto::SessionHeader* h = nullptr;  // for the atomics only
  std::vector<proto::TensorDesc> tensors;  // this rank's, by layer * kTensorKinds + kind
  bool loaded = false;                     // the last load_tensors() found the cache live
  std::vector<std::array<std::uint8_t, proto::kHandleBytes>> events;  // published; again after a re-grant
  std::unique_ptr<TaskRingReader> reader;
  Mutex complete_mu;  // the ring has one producer: the threads that complete tasks take turns
  std::unique_ptr<CompletionRing> completions PT_GUARDED_BY(complete_mu);
  std::atomic<std::uint32_t> epoch{0};  // written by the dispatcher, read by executor threads
  std::atomic<std::int64_t> poll_until_ns{0};  // expect_task_soon(): next_task polls until then
  std::uint64_t owner = 0;  // our owner word, once claimed

  proto::RankSlot& slot() { return h->ranks[opts.rank]; }

  // Waits until every live peer has left the agreement slot's previous task (seq minus
  // kAgreementSlots), so writing the slot never overwrites a word a peer has still to read.
  Status<proto::TaskStatus> wait_slot_free(std::uint64_t seq, std::int64_t deadline_ns);

  bool granted();

  bool engine_alive() const;

  // Claims the rank for this process: kInUse naming the live owner, else ours.
  Status<IpcErrc> claim();

  // Asks the engine for a new epoch and waits for the grant.
  bool request_grant();

  bool cache_live() const;

  // Copies and checks this rank's tensor descriptors if the cache is live; else forgets them.
  Result<bool, IpcErrc> load_tensors();

  // Copies and checks this rank's tensor descriptors.
  Status<IpcErrc> copy_tensors();
};

}  // namespace kvtd::endpoint
