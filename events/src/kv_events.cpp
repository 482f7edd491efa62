#include "kvtd/events/kv_events.h"

#include <chrono>
#include <thread>
#include <zmq.hpp>

#include "event_encoding.h"
#include "kvtd/base/mutex.h"
#include "kvtd/base/thread_annotations.h"
#include "kvtd/listeners/zmq_listener_guard.h"

namespace kvtd::events {
namespace {

constexpr std::size_t kMaxEventsPerBatch = 1024;
constexpr int kHandshakeMs = 2000;

// vLLM's ZmqEventPublisher rule (kv_events.py, _socket_setup): bind a wildcard, ipc or inproc
// endpoint, connect to anything else.
bool binds(const std::string& endpoint) {
  return endpoint.find('*') != std::string::npos || endpoint.find("::") != std::string::npos ||
         endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct KvEventPublisher::Impl {
  KvEventsOptions options;
  std::string endpoint;
  zmq::context_t context{1};
  zmq::socket_t socket;  // used by `sender` only, once open() has handed it over

  mutable Mutex mu;
  CondVar wake;
  std::vector<KvEvent> queue GUARDED_BY(mu);
  std::size_t queued_events GUARDED_BY(mu) = 0;  // keys (a clear counts one)
  std::size_t queued_bytes GUARDED_BY(mu) = 0;   // the keys' bytes
  bool stopping GUARDED_BY(mu) = false;
  KvEventsStats stats GUARDED_BY(mu);
  std::uint64_t next_seq = 0;  // sender thread only
  std::thread sender;
  std::unique_ptr<listeners::ZmqListenerGuard> guard;  // bound tcp:// only; goes before the context

  static std::size_t bytes_of(const KvEvent& e) {
    std::size_t b = 0;
    for (const auto& k : e.keys) b += k.size();
    return b;
  }
  static std::size_t events_of(const KvEvent& e) { return e.keys.empty() ? 1 : e.keys.size(); }

  // Queues `e` if it fits the bounds; a removal or clear that does not is answered by a clear.
  void enqueue_locked(KvEvent&& e) REQUIRES(mu) {
    const std::size_t n = events_of(e), bytes = bytes_of(e);
    if (queued_events + n <= options.max_queued_events && queued_bytes + bytes <= options.max_queued_bytes) {
      queued_events += n;
      queued_bytes += bytes;
      queue.push_back(std::move(e));
      return;
    }
    stats.events_dropped += n;
    if (e.kind == KvEventKind::kStored) return;  // the router under-reports: a miss, not a lie
    // A lost removal: the router must forget everything rather than keep a key that is gone.
    // One clear at the tail is enough; it may pass the bound by that one event.
    if (queue.empty() || queue.back().kind != KvEventKind::kCleared) {
      ++queued_events;
      ++stats.clears_for_lost_removals;
      queue.push_back(KvEvent{KvEventKind::kCleared, {}});
    }
  }

  void push(KvEventKind kind, std::vector<std::string> keys) {
    {
      MutexLock g(mu);
      // Big events are cut into batch-sized ones, so no batch passes kMaxBatchBytes.
      std::vector<std::string> part;
      std::size_t part_bytes = 0;
      for (auto& k : keys) {
        if (!part.empty() && (part.size() == kMaxEventsPerBatch || part_bytes + k.size() > kMaxBatchBytes)) {
          enqueue_locked(KvEvent{kind, std::move(part)});
          part.clear();
          part_bytes = 0;
        }
        part_bytes += k.size();
        part.push_back(std::move(k));
      }
      if (!part.empty() || keys.empty()) enqueue_locked(KvEvent{kind, std::move(part)});
    }
    wake.notify_one();
  }

  void send(const std::vector<KvEvent>& batch) {
    BatchFields f;
    f.format = options.format;
    f.ts = wall_seconds();
    f.data_parallel_rank = options.data_parallel_rank;
    f.medium = options.medium;
    f.locality = options.locality;
    f.block_size = options.block_size;
    const std::string payload = encode_batch(batch, f);
    unsigned char seq[8];
    for (int i = 0; i < 8; ++i) seq[i] = static_cast<unsigned char>(next_seq >> (8 * (7 - i)));
    // PUB never blocks on a subscriber: past the high-water mark ZeroMQ drops the message.
    bool sent = socket.send(zmq::buffer(options.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait).has_value();
    sent = sent && socket.send(zmq::buffer(seq, sizeof seq), zmq::send_flags::sndmore | zmq::send_flags::dontwait).has_value();
    sent = sent && socket.send(zmq::buffer(payload), zmq::send_flags::dontwait).has_value();
    std::size_t events = 0;
    for (const auto& e : batch) events += e.keys.empty() ? 1 : e.keys.size();
    MutexLock g(mu);
    if (sent) {
      ++next_seq;
      ++stats.batches_sent;
      stats.events_sent += events;
    } else {
      stats.events_dropped += events;
    }
  }

  void run() {
    for (;;) {
      std::vector<KvEvent> batch;
      {
        MutexLock g(mu);
        wake.wait(g, [&]() REQUIRES(mu) { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping, all sent
        std::size_t events = 0, bytes = 0;
        std::size_t take = 0;
        while (take < queue.size() &&
               (take == 0 || (events + events_of(queue[take]) <= kMaxEventsPerBatch &&
                              bytes + bytes_of(queue[take]) <= kMaxBatchBytes))) {
          events += events_of(queue[take]);
          bytes += bytes_of(queue[take]);
          ++take;
        }
        batch.assign(std::make_move_iterator(queue.begin()), std::make_move_iterator(queue.begin() + static_cast<std::ptrdiff_t>(take)));
        queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(take));
        queued_events -= events;
        queued_bytes -= bytes;
      }
      send(batch);
    }
  }
};

Result<std::unique_ptr<KvEventPublisher>, EventsErrc> KvEventPublisher::open(const KvEventsOptions& o) {
  if (o.endpoint.empty()) return make_error(EventsErrc::kInvalidArgument, "--kv-events-endpoint: empty");
  if (o.medium.empty()) return make_error(EventsErrc::kInvalidArgument, "KV events: no medium named");
  if (o.max_queued_events == 0) return make_error(EventsErrc::kInvalidArgument, "KV events: a queue of 0 events");
  auto impl = std::make_unique<Impl>();
  impl->options = o;
  try {
    impl->socket = zmq::socket_t(impl->context, zmq::socket_type::pub);
    impl->socket.set(zmq::sockopt::sndhwm, o.send_high_water_mark);
    impl->socket.set(zmq::sockopt::linger, 1000);  // the destructor waits at most this for sends
    // A connection that has not finished ZeroMQ's handshake in 2 s is dropped by libzmq itself
    // (its default, 30 s, let raw connections greeting a byte every 0.2 s hold every slot).
    impl->socket.set(zmq::sockopt::handshake_ivl, kHandshakeMs);
    if (binds(o.endpoint)) {
      impl->socket.bind(o.endpoint);
      impl->endpoint = impl->socket.get(zmq::sockopt::last_endpoint);
      if (o.endpoint.rfind("tcp://", 0) == 0) {
        auto guard = listeners::ZmqListenerGuard::start(
            impl->context.handle(), impl->socket.handle(),
            // The oldest goes when one too many connect: a router reconnecting after a blip gets
            // in; idle holders (16 SUB sockets that never read) no longer keep it out.
            {"--kv-events-endpoint " + o.endpoint, o.max_subscribers, listeners::Evict::kOldest});
        if (!guard.ok()) return make_error(EventsErrc::kSocket, guard.error().message);
        impl->guard = std::move(guard).value();
      }
    } else {
      impl->socket.connect(o.endpoint);
      impl->endpoint = o.endpoint;
    }
  } catch (const zmq::error_t& e) {
    return make_error(EventsErrc::kSocket, "--kv-events-endpoint " + o.endpoint + ": " + e.what());
  }
  auto* raw = impl.get();
  impl->sender = std::thread([raw] { raw->run(); });
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

KvEventPublisher::~KvEventPublisher() {
  {
    MutexLock g(impl_->mu);
    impl_->stopping = true;
  }
  impl_->wake.notify_one();
  impl_->sender.join();
  impl_->socket.close();  // lingers up to 1 s for what is still in ZeroMQ's queue
}

void KvEventPublisher::stored(std::vector<std::string> keys) {
  if (!keys.empty()) impl_->push(KvEventKind::kStored, std::move(keys));
}

void KvEventPublisher::removed(std::vector<std::string> keys) {
  if (!keys.empty()) impl_->push(KvEventKind::kRemoved, std::move(keys));
}

void KvEventPublisher::cleared() { impl_->push(KvEventKind::kCleared, {}); }

KvEventsStats KvEventPublisher::stats() const {
  MutexLock g(impl_->mu);
  return impl_->stats;
}

const std::string& KvEventPublisher::endpoint() const { return impl_->endpoint; }

std::optional<KvEventsFormat> parse_kv_events_format(const std::string& name) {
  if (name == "map") return KvEventsFormat::kMap;
  if (name == "array") return KvEventsFormat::kArray;
  return std::nullopt;
}

}  // namespace kvtd::events
