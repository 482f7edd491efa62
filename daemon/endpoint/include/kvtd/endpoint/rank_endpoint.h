// kvtd/endpoint/rank_endpoint.h - the daemon's end of a session: attach, read tasks, report.
//
// attach() waits (bounded) for the engine's segment to appear and be published, refuses it
// when it is owned by another user, is not a kvtd session, has another layout version, a
// corrupt layout (every offset, stride and count is checked against the mapping in 64-bit
// arithmetic, then kept in private memory) or a geometry that differs from the daemon's flags
// (the message names the field). It then claims the rank (kInUse naming the pid when another
// live daemon serves it; a dead owner's claim is taken over), asks the engine for an attach
// grant and waits for it. The grant places this rank's task-ring cursor at the ring head: tasks
// submitted before the grant are not this epoch's.
//
// Ownership: RankEndpoint maps the segment and unmaps it on destruction, clearing its ready
// flags first. Not copyable or movable.
// Thread-safety: next_task() from one thread (the dispatcher); complete() from any thread
// (serialised inside); heartbeat(), set_ready() and the queries from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvtd/ipc/errors.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::endpoint {

using ipc::IpcErrc;  // the session contract's error codes (kvtd/ipc/errors.h)

struct EndpointOptions {
  std::string suffix;
  std::uint32_t rank = 0;
  proto::CacheGeometry expected{};          // from the daemon's flags (a group session: the groups' envelope)
  proto::CacheGroups expected_groups{};     // from the daemon's flags; num_groups 0: a single-shape session
  // What the daemon's flags declare the KV to be (its dtype, stage, slice) and the layout it acts
  // on (config::DaemonConfig::kv_layout): a session declaring otherwise is refused.
  proto::KvIdentity expected_identity{};
  proto::KvLayout expected_layout = proto::KvLayout::kUndeclared;
  std::int64_t attach_timeout_ns = 0;       // 0 = wait for the session forever
  std::int64_t grant_timeout_ns = 5'000'000'000;
  std::int64_t engine_timeout_ns = 5'000'000'000;  // engine heartbeat age that counts as gone
  std::uint64_t skip_generation = 0;        // a session generation we just left: ignore it
  const std::atomic<bool>* stop = nullptr;  // abandon waiting when set
  std::function<void(const std::string&)> on_waiting;  // called every few seconds while waiting
  std::function<void()> on_poll;            // called on every poll of the wait (>= 50 Hz)
  // Tests: called by agree() after this rank published its count and before it reads the peers'
  // (a rank descheduled right there is how a slot reuse used to fail healthy tasks).
  std::function<void(std::uint64_t seq)> on_agreement_published;
};

class RankEndpoint {
 public:
  enum class Next { kTask, kTimeout, kRegranted, kLost, kCorrupt };

  static Result<std::unique_ptr<RankEndpoint>, IpcErrc> attach(const EndpointOptions& options);
  ~RankEndpoint();
  RankEndpoint(const RankEndpoint&) = delete;
  RankEndpoint& operator=(const RankEndpoint&) = delete;

  // Waits until deadline for the next task record, copied into `record`.
  //   kTask: a record is in `record` (not yet validated: the dispatcher does that); it was read
  //   while this epoch was still granted.
  //   kTimeout: none arrived. kRegranted: the engine had declared us dead; we asked for and got
  //   a new grant (tasks in between are lost to us and were failed by the engine; the caller
  //   must drop any work of the revoked epoch it still holds).
  //   kLost: the engine closed the session or stopped heartbeating. kCorrupt: broken framing.
  Next next_task(std::vector<std::byte>& record, std::int64_t deadline_ns);

  // Publishes one completion record. Fails only if the engine stopped draining (ring full).
  Status<IpcErrc> complete(const proto::CompletionRecord& record);
  // Says the next task is likely within `window_ns` (an engine with one task in flight submits
  // right after a completion): a next_task() asleep is woken and polls the ring, yielding the
  // core, until then, so the submit does not wait for a sleeping thread's wake-up. Any thread.
  // Best effort: one falling asleep at that instant misses the wake and sleeps until the engine
  // publishes, as it would have without this call (see ipc::wake_sleepers).
  void expect_task_soon(std::int64_t window_ns);

  // Layer progress of a layer-by-layer task (see proto::LayerProgressSlot): begin once, then
  // update after each layer; every update wakes an engine waiting in wait_layer().
  void progress_begin(const proto::TaskRecordHeader& task);
  void progress_update(const proto::TaskRecordHeader& task, std::uint32_t layers_enqueued, std::uint32_t layers_done);
  // Publishes this rank's per-layer interprocess event handles (at most num_layers).
  void publish_layer_events(const std::vector<std::array<std::uint8_t, proto::kHandleBytes>>& handles);

  // Agreement across ranks for the storage task with ring sequence number `seq` (see
  // proto::AgreementControl): publishes `count`, waits until every rank published, returns the
  // MIN. Before writing the task's slot it waits until every live peer has left the slot's
  // previous task (RankSlot::agreement_left), so no healthy task fails because a peer was slow.
  // Never hangs: fails with the status a rank aborted with (naming that rank; the slot
  // reused: kAgreementFailed),
  // kRankDead when the engine stopped counting a peer as live (dead, fenced, re-attached: it will
  // never publish), kShuttingDown when this rank's own epoch was revoked or the session is lost,
  // kDeadlineExceeded at `deadline_ns` (0 = none). The message names the rank. Any thread.
  Result<std::uint32_t, proto::TaskStatus> agree(std::uint64_t seq, std::uint32_t count, std::int64_t deadline_ns);
  // Tells the other ranks this rank failed task `seq` with `why` before agreeing: they stop
  // waiting and report `why` too, naming this rank.
  void abort_agreement(std::uint64_t seq, proto::TaskStatus why = proto::TaskStatus::kAgreementFailed);
  // Tells the peers this rank reads no agreement slot of a task below `below_seq` any more (agree()
  // does it for the tasks it runs). For the thread that runs agreements in ring order, after
  // tasks it failed without agreeing, or for a rank with no such thread at all.
  void leave_agreements(std::uint64_t below_seq);

  // Task-ring positions (bytes): what the engine has published, and what this rank has read.
  // A stopping daemon finishes the records published before it stopped, and no more.
  std::uint64_t ring_published() const;
  std::uint64_t ring_read() const;

  // Whether the engine still counts this epoch as live. Work read under an epoch that is no
  // longer granted must be dropped: the engine has failed it and may reuse its blocks.
  bool granted() const;

  void heartbeat();                        // stores now into this rank's heartbeat slot
  void set_ready(std::uint32_t flags);     // ReadyFlag bits
  bool engine_alive() const;               // published, not closed, heartbeat fresh
  bool engine_closed() const;              // the engine closed the session (it did not die)

  // Weight updates (see proto::CacheState). cache_live(): the engine's cache state now.
  // load_tensors(): re-reads and checks this rank's tensor registry if the cache is live (true),
  // else forgets every descriptor (false); kCorrupt naming the entry. attach() calls it once
  // after the grant; the daemon again for RESTORE_CACHE. Dispatcher thread only.
  bool cache_live() const;
  Result<bool, IpcErrc> load_tensors();
  bool tensors_loaded() const;  // what the last load_tensors() returned

  // The session's geometry, validated and copied at attach.
  const proto::CacheGeometry& geometry() const;
  // The session's cache groups (num_groups 0 for a single-shape session), validated and copied at
  // attach.
  const proto::CacheGroups& groups() const;
  // This rank's registered tensor (a private copy made by load_tensors(), checked for rank,
  // layer, kind and size), or null if the geometry has none of that kind or the cache was
  // cleared when it was loaded. In a group session `kind` is the layer's slot (proto::group_slot).
  const proto::TensorDesc* tensor(std::uint32_t layer, proto::TensorKind kind) const;
  std::uint32_t rank() const;
  std::uint64_t generation() const;
  // The pid of the process that made the session (SessionHeader::creator_pid), read once at
  // attach: the only process whose own memory (/proc/<pid>/fd/<fd>) a tensor may name.
  std::uint32_t engine_pid() const;
  // Whether process `pid` of this pid namespace maps this session's segment (the same file, by
  // inode): the engine that made it does; a process the engine merely names does not.
  bool mapped_by(std::uint32_t pid) const;
  // Whether the engine runs in this daemon's pid namespace: only then does engine_pid() (or a
  // /proc/<pid> path the engine registered) name the engine here.
  bool engine_in_our_pid_namespace() const;
  // Whether the engine asks this rank's daemon to take over the host pool it kept from this
  // suffix's dead previous session (proto::SessionHeader::take_over_host_tier). Read once at attach.
  bool take_over_host_tier() const;
  std::uint32_t epoch() const;

 private:
  struct Impl;
  explicit RankEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::endpoint
