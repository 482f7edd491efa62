#include "kvtd/ipc/rank_endpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/rings.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "segment.h"

namespace kvtd::ipc {

struct RankEndpoint::Impl {
  EndpointOptions opts;
  std::unique_ptr<detail::SharedMapping> mapping;
  proto::SessionHeader* h = nullptr;
  std::unique_ptr<TaskRingReader> reader;
  std::unique_ptr<CompletionRing> completions;
  std::mutex complete_mu;
  std::uint32_t epoch = 0;

  proto::RankSlot& slot() { return h->ranks[opts.rank]; }

  bool granted() {
    return slot().attached.load(std::memory_order_acquire) != 0 &&
           slot().attached_epoch.load(std::memory_order_acquire) == epoch;
  }

  bool engine_alive() const {
    if (h->state.load(std::memory_order_acquire) != static_cast<std::uint32_t>(proto::SessionState::kReady)) return false;
    return monotonic_now_ns() - h->engine_heartbeat_ns.load(std::memory_order_acquire) <= opts.engine_timeout_ns;
  }

  // Asks the engine for a new epoch and waits for the grant.
  bool request_grant() {
    auto& s = slot();
    epoch = s.attach_request.load() + 1;
    if (epoch == 0) epoch = 1;
    s.pid.store(static_cast<std::uint32_t>(getpid()));
    s.heartbeat_ns.store(monotonic_now_ns(), std::memory_order_release);
    s.attach_request.store(epoch, std::memory_order_release);
    const std::int64_t deadline = monotonic_now_ns() + opts.grant_timeout_ns;
    for (;;) {
      const std::uint32_t seen = h->publish_word.load(std::memory_order_acquire);
      if (granted()) return true;
      if (!engine_alive()) return false;
      if (opts.stop && opts.stop->load()) return false;
      const std::int64_t now = monotonic_now_ns();
      if (now >= deadline) return false;
      s.heartbeat_ns.store(now, std::memory_order_release);
      (void)wait_on_word(h->publish_word, seen, std::min(deadline, now + 20'000'000), &h->consumer_waiters, 0);
    }
  }
};

RankEndpoint::RankEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RankEndpoint::~RankEndpoint() {
  auto& s = impl_->slot();
  s.ready_flags.store(0, std::memory_order_release);
  // Tell the engine at once that this epoch is gone, so it fails what is still pending for us
  // now instead of after the heartbeat timeout. Our completions were all written before this.
  s.leaving_epoch.store(impl_->epoch, std::memory_order_release);
}

Result<std::unique_ptr<RankEndpoint>, IpcErrc> RankEndpoint::attach(const EndpointOptions& o) {
  if (!proto::valid_session_suffix(o.suffix))
    return make_error(IpcErrc::kInvalidArgument, "session suffix '" + o.suffix + "' must be 1-64 of [A-Za-z0-9_.-]");
  if (o.rank >= proto::kMaxRanks) return make_error(IpcErrc::kInvalidArgument, "rank out of range");
  const std::string name = detail::session_name(o.suffix);
  const std::int64_t start = monotonic_now_ns();
  std::int64_t last_note = start;
  std::string waiting_for = "session " + name + " to appear";

  for (;;) {
    const std::int64_t now = monotonic_now_ns();
    if (o.stop && o.stop->load()) return make_error(IpcErrc::kClosed, "stopped while waiting for " + waiting_for);
    if (o.attach_timeout_ns > 0 && now - start >= o.attach_timeout_ns)
      return make_error(IpcErrc::kTimeout, "gave up after " + std::to_string((now - start) / 1'000'000) +
                                               " ms waiting for " + waiting_for);
    if (o.on_poll) o.on_poll();
    if (o.on_waiting && now - last_note >= 5'000'000'000) {
      o.on_waiting("waiting for " + waiting_for);
      last_note = now;
    }

    auto opened = detail::open_mapping(name);
    if (!opened.ok()) {
      if (opened.error().code != IpcErrc::kNotFound) return std::move(opened).error();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    auto m = std::move(opened).value();
    if (m->owner_uid != getuid())
      return make_error(IpcErrc::kPermission, "session " + name + " is owned by uid " + std::to_string(m->owner_uid) +
                                                  ", not by this daemon's uid " + std::to_string(getuid()));
    if ((m->mode & 077) != 0)
      return make_error(IpcErrc::kPermission, "session " + name + " has mode 0" + std::to_string((m->mode >> 6) & 7) +
                                                  std::to_string((m->mode >> 3) & 7) + std::to_string(m->mode & 7) +
                                                  "; it must not be accessible to group or others");
    auto* h = reinterpret_cast<proto::SessionHeader*>(m->data);
    if (m->size < sizeof(proto::SessionHeader)) {  // still being sized by the engine
      waiting_for = "session " + name + " to be initialised";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    const std::uint64_t magic = reinterpret_cast<std::atomic<std::uint64_t>*>(&h->magic)->load(std::memory_order_acquire);
    if (magic == 0) {
      waiting_for = "session " + name + " to be initialised";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (magic != proto::kSessionMagic)
      return make_error(IpcErrc::kBadMagic, "shared memory object " + name + " is not a kvtd session (bad magic)");
    if (h->layout_version != proto::kSessionLayoutVersion || h->header_bytes != sizeof(proto::SessionHeader))
      return make_error(IpcErrc::kBadVersion, "session " + name + " has layout version " +
                                                  std::to_string(h->layout_version) + ", this daemon speaks " +
                                                  std::to_string(proto::kSessionLayoutVersion));
    const auto state = static_cast<proto::SessionState>(h->state.load(std::memory_order_acquire));
    const bool stale = monotonic_now_ns() - h->engine_heartbeat_ns.load() > o.engine_timeout_ns;
    if (h->generation == o.skip_generation || state == proto::SessionState::kClosed || stale) {
      waiting_for = "a new session " + name + " (the current one is closed or its engine is gone)";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (state != proto::SessionState::kReady) {
      waiting_for = "session " + name + " to be published";
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    if (m->size < h->total_bytes)
      return make_error(IpcErrc::kBadMagic, "session " + name + " is truncated");
    if (o.rank >= h->geometry.num_ranks)
      return make_error(IpcErrc::kGeometryMismatch, "rank: this daemon is rank " + std::to_string(o.rank) +
                                                        " but the session has " +
                                                        std::to_string(h->geometry.num_ranks) + " ranks");
    if (auto diff = detail::geometry_mismatch(h->geometry, o.expected); !diff.empty())
      return make_error(IpcErrc::kGeometryMismatch, "session " + name + " disagrees on " + diff);

    auto impl = std::make_unique<Impl>();
    impl->opts = o;
    impl->h = h;
    impl->mapping = std::move(m);
    impl->reader = std::make_unique<TaskRingReader>(h, detail::ring_bytes(h), h->task_ring_bytes, o.rank);
    impl->completions = std::make_unique<CompletionRing>(detail::completion_control(h, o.rank),
                                                         detail::completion_records(h, o.rank), h->completion_capacity);
    if (!impl->request_grant()) {
      if (o.stop && o.stop->load()) return make_error(IpcErrc::kClosed, "stopped while waiting for the attach grant");
      if (!impl->engine_alive()) {
        waiting_for = "a new session " + name + " (the engine left during attach)";
        continue;
      }
      return make_error(IpcErrc::kTimeout, "engine did not grant rank " + std::to_string(o.rank) + " attach within " +
                                               std::to_string(o.grant_timeout_ns / 1'000'000) + " ms");
    }
    return std::unique_ptr<RankEndpoint>(new RankEndpoint(std::move(impl)));
  }
}

RankEndpoint::Next RankEndpoint::next_task(std::vector<std::byte>& record, std::int64_t deadline_ns) {
  auto* impl = impl_.get();
  auto* h = impl->h;
  for (;;) {
    if (!impl->granted()) {
      if (!impl->engine_alive()) return Next::kLost;
      return impl->request_grant() ? Next::kRegranted : Next::kLost;
    }
    const std::uint32_t seen = h->publish_word.load(std::memory_order_acquire);
    switch (impl->reader->try_pop(record)) {
      case TaskRingReader::Read::kRecord:
        bump_and_wake(h->space_word, &h->producer_waiters);
        return Next::kTask;
      case TaskRingReader::Read::kCorrupt: return Next::kCorrupt;
      case TaskRingReader::Read::kEmpty: break;
    }
    if (!impl->engine_alive()) return Next::kLost;
    const std::int64_t now = monotonic_now_ns();
    if (now >= deadline_ns) return Next::kTimeout;
    (void)wait_on_word(h->publish_word, seen, deadline_ns, &h->consumer_waiters, 50'000);
  }
}

Status<IpcErrc> RankEndpoint::complete(const proto::CompletionRecord& record) {
  {
    std::lock_guard<std::mutex> g(impl_->complete_mu);
    if (!impl_->completions->try_push(record))
      return make_error(IpcErrc::kRingFull, "completion ring of rank " + std::to_string(impl_->opts.rank) +
                                                " is full: the engine is not draining it");
  }
  bump_and_wake(impl_->h->completion_word, &impl_->h->completion_waiters);
  bump_and_wake(impl_->h->progress_word, &impl_->h->progress_waiters);  // ends wait_layer on failures too
  return {};
}

void RankEndpoint::progress_begin(const proto::TaskRecordHeader& task) {
  auto* slot = detail::progress_slot(impl_->h, impl_->opts.rank, task.seq);
  slot->task_id.store(0, std::memory_order_release);
  slot->layers_enqueued.store(0, std::memory_order_release);
  slot->layers_done.store(0, std::memory_order_release);
  slot->task_id.store(task.task_id, std::memory_order_release);
}

void RankEndpoint::progress_update(const proto::TaskRecordHeader& task, std::uint32_t layers_enqueued,
                                   std::uint32_t layers_done) {
  auto* slot = detail::progress_slot(impl_->h, impl_->opts.rank, task.seq);
  slot->layers_enqueued.store(layers_enqueued, std::memory_order_release);
  slot->layers_done.store(layers_done, std::memory_order_release);
  bump_and_wake(impl_->h->progress_word, &impl_->h->progress_waiters);
}

void RankEndpoint::publish_layer_events(const std::vector<std::array<std::uint8_t, proto::kHandleBytes>>& handles) {
  auto* h = impl_->h;
  const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(handles.size(), h->geometry.num_layers));
  for (std::uint32_t l = 0; l < n; ++l)
    std::memcpy(detail::event_handle(h, impl_->opts.rank, l), handles[l].data(), proto::kHandleBytes);
  detail::progress_control(h, impl_->opts.rank)->events_published.store(n, std::memory_order_release);
}

void RankEndpoint::heartbeat() { impl_->slot().heartbeat_ns.store(monotonic_now_ns(), std::memory_order_release); }
void RankEndpoint::set_ready(std::uint32_t flags) { impl_->slot().ready_flags.store(flags, std::memory_order_release); }
bool RankEndpoint::engine_alive() const { return impl_->engine_alive(); }
const proto::SessionHeader& RankEndpoint::header() const { return *impl_->h; }
const proto::CacheGeometry& RankEndpoint::geometry() const { return impl_->h->geometry; }
std::uint32_t RankEndpoint::rank() const { return impl_->opts.rank; }
std::uint64_t RankEndpoint::generation() const { return impl_->h->generation; }
std::uint32_t RankEndpoint::epoch() const { return impl_->epoch; }

const proto::TensorDesc* RankEndpoint::tensor(std::uint32_t layer, proto::TensorKind kind) const {
  const auto& g = impl_->h->geometry;
  if (layer >= g.num_layers || !g.has_tensor(kind)) return nullptr;
  const auto* d = &detail::registry(impl_->h)[proto::registry_index(g, impl_->opts.rank, layer, kind)];
  return d->valid ? d : nullptr;
}

}  // namespace kvtd::ipc
