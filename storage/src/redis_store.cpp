#include "kvtd/base/mutex.h"
#include "kvtd/storage/redis_store.h"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <hiredis/sds.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "kvtd/proto/names.h"
#include "redis_support.h"
#include "split_store.h"
#include "store_common.h"
#include "kvtd/storage/object_format.h"

namespace kvtd::storage {

std::uint16_t redis_cluster_slot(const std::string& key) {
  std::size_t begin = 0, len = key.size();
  const auto open = key.find('{');
  if (open != std::string::npos) {
    const auto close = key.find('}', open + 1);
    if (close != std::string::npos && close > open + 1) {
      begin = open + 1;
      len = close - open - 1;
    }
  }
  std::uint16_t crc = 0;
  for (std::size_t i = begin; i < begin + len; ++i) {
    crc = static_cast<std::uint16_t>(crc ^ (static_cast<std::uint8_t>(key[i]) << 8));
    for (int b = 0; b < 8; ++b)
      crc = static_cast<std::uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
  }
  return static_cast<std::uint16_t>(crc % 16384);
}

namespace {

using detail::Clock;
using detail::Node;
using detail::parse_endpoint;
using detail::Reply;

enum class Op { kGet, kSet, kExists, kDel };

class RedisStore final : public ObjectStore {
 public:
  explicit RedisStore(RedisStoreOptions o) : o_(std::move(o)) {}

  Status<StorageErrc> init() {
    if (!o_.password_file.empty()) {
      std::ifstream in(o_.password_file);
      if (!in || !std::getline(in, password_))
        return make_error(StorageErrc::kInvalidArgument, "cannot read the Redis password file " + o_.password_file);
    } else if (!o_.password_env.empty()) {
      const char* v = std::getenv(o_.password_env.c_str());
      if (!v) return make_error(StorageErrc::kInvalidArgument, "environment variable " + o_.password_env + " is not set");
      password_ = v;
    }
    for (const auto& e : o_.endpoints) {
      std::string host;
      int port = 0;
      if (!parse_endpoint(e, &host, &port))
        return make_error(StorageErrc::kInvalidArgument, "Redis endpoint '" + e + "' is not host:port");
      MutexLock g(mu_);
      node(host, port);
    }
    if (o_.endpoints.empty()) return make_error(StorageErrc::kInvalidArgument, "no Redis endpoint given");
    MutexLock g(mu_);
    if (!o_.cluster && o_.detect_cluster) detect_pending_ = !detect_locked(deadline());
    if (o_.cluster) KVTD_TRY(refresh_slots(deadline()));
    return {};
  }

  // Asks the first reachable endpoint whether it is a Cluster node (CLUSTER INFO). False when none
  // answered: the caller asks again later (a cluster down at start is found once it is up).
  bool detect_locked(Clock::time_point dl) REQUIRES(mu_) {
    for (auto& [id, n] : nodes_) {
      redisContext* c = connect(*n, dl);
      if (!c) continue;
      Reply r(static_cast<redisReply*>(redisCommand(c, "CLUSTER INFO")));
      if (!r) {
        n->drop();
        continue;
      }
      // A Cluster node answers a status text; a standalone server an error ("cluster support disabled").
      o_.cluster = (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) &&
                   std::string_view(r->str, r->len).find("cluster_state:") != std::string_view::npos;
      if (o_.cluster) refresh_needed_ = true;
      return true;
    }
    return false;
  }

  StoreCapabilities capabilities() const override { return {.reads_in_place = false, .writes_pieces = true}; }

  Result<std::size_t, StorageErrc> exists(std::span<const std::string> keys) override {
    KVTD_TRY(detail::check_keys(keys));
    std::vector<KeyResult> r;
    KVTD_TRY(run(Op::kExists, keys, {}, nullptr, &r));
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (r[i].result == ObjectResult::kFailed)
        return make_error(StorageErrc::kUnavailable, "Redis did not answer EXISTS for key " + keys[i] + ": " + r[i].error);
      if (r[i].result != ObjectResult::kOk) return i;
    }
    return keys.size();
  }

  // Each verified payload is copied into its pieces under the store's lock; on_verified runs
  // after, outside it, so a caller's copy onward (a DMA) never holds the connections.
  BatchResult read(std::span<const std::string> keys, const ReadInto& into) override {
    KVTD_TRY(detail::check_read(keys, into));
    std::vector<KeyResult> r;
    KVTD_TRY(run(Op::kGet, keys, {}, &into, &r));
    for (std::size_t i = 0; i < r.size(); ++i) {
      counters_.count_get(r[i].result);
      if (r[i].ok() && into.on_verified) into.on_verified(i);
    }
    return r;
  }

  // Every object's pieces are asked for first, outside the store's lock (a caller gathering from
  // a device must not hold the connections), then sent gathered, straight from them.
  BatchResult write(std::span<const std::string> keys, const WriteFrom& from) override {
    KVTD_TRY(detail::check_write(keys, from));
    std::vector<std::optional<ConstPieces>> sources(keys.size());
    std::vector<KeyResult> refused(keys.size(), KeyResult{ObjectResult::kOk, {}});
    for (std::size_t i = 0; i < keys.size(); ++i) {
      sources[i] = from.pieces(i);
      if (!sources[i]) {
        refused[i] = {ObjectResult::kFailed, "not written: " + from.refused};
      } else if (auto bad = detail::pieces_mismatch(i, *sources[i], o_.store.object_bytes); !bad.empty()) {
        refused[i] = {ObjectResult::kFailed, bad};
        sources[i].reset();
      }
    }
    std::vector<KeyResult> r;
    KVTD_TRY(run(Op::kSet, keys, sources, nullptr, &r));
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (!refused[i].ok()) r[i] = refused[i];
      counters_.count_put(r[i].result);
    }
    return r;
  }

  Status<StorageErrc> remove(std::span<const std::string> keys) override {
    KVTD_TRY(detail::check_keys(keys));
    std::vector<KeyResult> r;
    KVTD_TRY(run(Op::kDel, keys, {}, nullptr, &r));
    for (std::size_t i = 0; i < r.size(); ++i)
      if (r[i].result == ObjectResult::kFailed)
        return make_error(StorageErrc::kUnavailable, "DEL of " + keys[i] + " failed: " + r[i].error);
    return {};
  }

  StoreStats stats() const override { return counters_.snapshot(); }

  // SCAN each master one step at a time, the store's lock taken per step, so storage tasks
  // interleave with a long collection instead of waiting for it.
  Result<GcReport, StorageErrc> collect(const GcRequest& request) override {
    std::vector<Node*> servers;
    {
      MutexLock g(mu_);
      if (detect_pending_) detect_pending_ = !detect_locked(deadline());
      if (o_.cluster && refresh_needed_) (void)refresh_slots(deadline());
      for (Node* n : slots_)
        if (n != nullptr && std::find(servers.begin(), servers.end(), n) == servers.end()) servers.push_back(n);
      if (servers.empty()) servers.push_back(nodes_.begin()->second.get());  // standalone
    }
    GcReport report;
    for (Node* n : servers) {
      unsigned long long cursor = 0;
      do {
        const auto now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
        if (request.deadline_ns != 0 && now_ns > request.deadline_ns) {
          report.complete = false;
          return report;
        }
        MutexLock g(mu_);
        std::string why;
        redisContext* c = connect(*n, deadline());
        auto next = c ? detail::gc_scan_step(c, cursor, request, o_.store.model_id, &report, &why) : std::nullopt;
        if (!next) {
          if (c) fail_connection(*n);
          return make_error(StorageErrc::kUnavailable, fmt::format("garbage collection: Redis {}:{} did not answer: {}",
                                                                   n->host, n->port, why.empty() ? failure_ : why));
        }
        cursor = *next;
      } while (cursor != 0);
    }
    return report;
  }

 private:
  Clock::time_point deadline() const { return Clock::now() + std::chrono::milliseconds(o_.timeout_ms); }

  Node* node(const std::string& host, int port) REQUIRES(mu_) {
    const std::string id = fmt::format("{}:{}", host, port);
    auto& n = nodes_[id];
    if (!n) {
      n = std::make_unique<Node>();
      n->host = host;
      n->port = port;
    }
    return n.get();
  }

  // A live connection to `n`, or null (down, or still backing off). *reused: it was made before
  // this call (it may have gone stale while idle: a server restart is found only on use).
  redisContext* connect(Node& n, Clock::time_point deadline, bool* reused = nullptr) REQUIRES(mu_) {
    if (reused) *reused = n.ctx && n.ctx->err == 0;
    if (n.ctx && n.ctx->err == 0) return n.ctx;
    n.drop();
    const auto now = Clock::now();
    if (now < n.retry_at) {
      // Not tried: say so, rather than leave the failure of the call that armed the backoff as
      // this call's error.
      failure_ = fmt::format("not tried: {}:{} is in its reconnect backoff for {} ms more, after: {}", n.host, n.port,
                             std::chrono::duration_cast<std::chrono::milliseconds>(n.retry_at - now).count(),
                             n.failure);
      return nullptr;
    }
    if (now >= deadline) {
      failure_ = fmt::format("no time left to connect to {}:{} within the call's deadline", n.host, n.port);
      return nullptr;
    }
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now).count();
    timeval tv{static_cast<time_t>(left / 1'000'000), static_cast<suseconds_t>(left % 1'000'000)};
    redisContext* c = redisConnectWithTimeout(n.host.c_str(), n.port, tv);
    bool ok = c != nullptr && c->err == 0;
    if (ok) {
      const auto per_reply = std::chrono::microseconds(o_.timeout_ms * 1000);
      timeval rtv{static_cast<time_t>(per_reply.count() / 1'000'000),
                  static_cast<suseconds_t>(per_reply.count() % 1'000'000)};
      redisSetTimeout(c, rtv);
      if (!password_.empty()) {
        Reply r(static_cast<redisReply*>(redisCommand(c, "AUTH %b", password_.data(), password_.size())));
        ok = r && r->type != REDIS_REPLY_ERROR;
        if (!ok) failure_ = r ? std::string(r->str, r->len) : "AUTH got no reply";
      }
    } else {
      failure_ = c ? c->errstr : "cannot allocate a Redis context";
    }
    if (!ok) {
      if (c) redisFree(c);
      n.failure = failure_;
      n.backoff_ms = n.backoff_ms == 0 ? 50 : std::min(n.backoff_ms * 2, o_.max_backoff_ms);
      n.retry_at = Clock::now() + std::chrono::milliseconds(n.backoff_ms);
      return nullptr;
    }
    n.backoff_ms = 0;
    n.ctx = c;
    return c;
  }

  Status<StorageErrc> refresh_slots(Clock::time_point deadline) REQUIRES(mu_) {
    for (auto& [id, n] : nodes_) {
      redisContext* c = connect(*n, deadline);
      if (!c) continue;
      Reply r(static_cast<redisReply*>(redisCommand(c, "CLUSTER SLOTS")));
      if (!r || r->type != REDIS_REPLY_ARRAY) {
        if (!r) n->drop();
        continue;
      }
      slots_.fill(nullptr);
      for (std::size_t i = 0; i < r->elements; ++i) {
        const redisReply* e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3) continue;
        const redisReply* master = e->element[2];
        if (master->type != REDIS_REPLY_ARRAY || master->elements < 2) continue;
        Node* owner = node(std::string(master->element[0]->str, master->element[0]->len),
                           static_cast<int>(master->element[1]->integer));
        for (long long s = e->element[0]->integer; s <= e->element[1]->integer && s < 16384; ++s)
          slots_[static_cast<std::size_t>(s)] = owner;
      }
      refresh_needed_ = false;
      return {};
    }
    return make_error(StorageErrc::kUnavailable, "no Redis Cluster node answered CLUSTER SLOTS: " + failure_);
  }

  Node* owner_of(const std::string& key) REQUIRES(mu_) {
    if (!o_.cluster) return nodes_.begin()->second.get();
    Node* n = slots_[redis_cluster_slot(key)];
    return n ? n : nodes_.begin()->second.get();
  }

  // Runs one operation over a batch of checked keys: groups keys by node, pipelines each group, follows
  // MOVED/ASK redirects a few times. results[i] is per key. A SET sends srcs[i] (a key whose
  // source is nullopt is skipped, its result left to the caller); a GET lands in `into`.
  Status<StorageErrc> run(Op op, std::span<const std::string> keys, std::span<const std::optional<ConstPieces>> srcs,
                          const ReadInto* into, std::vector<KeyResult>* results) {
    MutexLock g(mu_);
    const auto dl = deadline();
    if (detect_pending_) detect_pending_ = !detect_locked(dl);
    if (o_.cluster && refresh_needed_) (void)refresh_slots(dl);
    results->assign(keys.size(), KeyResult{ObjectResult::kFailed, "not sent: no attempt reached its server"});
    std::vector<std::string> names(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) names[i] = "kvtd:" + namespaced_key(o_.store, keys[i]);

    std::vector<std::size_t> pending_keys(keys.size());
    pending_keys.clear();
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (op != Op::kSet || srcs[i]) pending_keys.push_back(i);
    std::map<std::size_t, Node*> ask;  // key index -> node named by ASK
    for (int attempt = 0; attempt < 5 && !pending_keys.empty(); ++attempt) {
      std::map<Node*, std::vector<std::size_t>> groups;
      for (auto i : pending_keys) {
        auto a = ask.find(i);
        groups[a != ask.end() ? a->second : owner_of(names[i])].push_back(i);
      }
      pending_keys.clear();
      for (auto& [n, idx] : groups) pipeline(*n, op, idx, names, {srcs, into}, dl, results, &pending_keys, &ask);
      if (!pending_keys.empty() && o_.cluster && refresh_needed_) (void)refresh_slots(dl);
    }
    return {};
  }

  // Where a SET's bytes come from and a GET's go.
  struct Payloads {
    std::span<const std::optional<ConstPieces>> srcs;
    const ReadInto* into;
  };

  void pipeline(Node& n, Op op, const std::vector<std::size_t>& idx, const std::vector<std::string>& names,
                const Payloads& payloads, Clock::time_point dl, std::vector<KeyResult>* results,
                std::vector<std::size_t>* retry, std::map<std::size_t, Node*>* ask) REQUIRES(mu_) {
    bool reused = false;
    redisContext* c = connect(n, dl, &reused);
    if (!c) {
      for (auto i : idx) (*results)[i] = {ObjectResult::kFailed, failure_};
      return;
    }
    // A connection made before this call that fails now was most likely left stale by a server
    // restart: retry the group once on a fresh connection, without the reconnect backoff (the
    // next tasks used to fail storage_unavailable). A fresh connection that fails is the server.
    auto lost = [&]() REQUIRES(mu_) {
      if (!reused) {
        fail_connection(n);
        for (auto i : idx)
          if ((*results)[i].result == ObjectResult::kFailed) (*results)[i].error = failure_;
        return;
      }
      failure_ = n.ctx && n.ctx->errstr[0] ? n.ctx->errstr : "connection lost";
      n.drop();
      for (auto i : idx) (*results)[i] = {ObjectResult::kFailed, failure_};
      retry->insert(retry->end(), idx.begin(), idx.end());
    };
    std::vector<bool> asking(idx.size(), false);
    for (std::size_t j = 0; j < idx.size(); ++j) {
      const std::size_t i = idx[j];
      if (ask->count(i)) {
        if (op != Op::kSet) redisAppendCommand(c, "ASKING");  // send_set sends its own
        asking[j] = true;
        ask->erase(i);
      }
      const std::string& key = names[i];
      switch (op) {
        case Op::kGet: redisAppendCommand(c, "GET %b", key.data(), key.size()); break;
        case Op::kExists: redisAppendCommand(c, "EXISTS %b", key.data(), key.size()); break;
        case Op::kDel: redisAppendCommand(c, "DEL %b", key.data(), key.size()); break;
        case Op::kSet:
          if (!detail::send_set(c, key, make_header(o_.store, key.substr(5), *payloads.srcs[i]), *payloads.srcs[i],
                                o_.store.object_bytes, o_.ttl_s, asking[j]))
            return lost();
          break;
      }
    }
    for (std::size_t j = 0; j < idx.size(); ++j) {
      const std::size_t i = idx[j];
      if (asking[j]) {
        void* raw = nullptr;
        if (redisGetReply(c, &raw) != REDIS_OK) return lost();
        freeReplyObject(raw);
      }
      void* raw = nullptr;
      if (redisGetReply(c, &raw) != REDIS_OK) return lost();
      Reply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_ERROR) {
        on_error_reply(std::string(r->str, r->len), i, names, results, retry, ask);
        continue;
      }
      (*results)[i] = result_of(op, *r, names[i], i, payloads.into);
    }
  }

  // An error reply to key i: a Cluster redirect (MOVED: the slot map changes; ASK: this key once)
  // queues the key for a retry; anything else fails it.
  void on_error_reply(const std::string& err, std::size_t i, const std::vector<std::string>& names,
                      std::vector<KeyResult>* results, std::vector<std::size_t>* retry,
                      std::map<std::size_t, Node*>* ask) REQUIRES(mu_) {
    if (o_.cluster && (err.rfind("MOVED ", 0) == 0 || err.rfind("ASK ", 0) == 0)) {
      // "MOVED <slot> <host>:<port>" / "ASK <slot> <host>:<port>"
      const auto sp = err.rfind(' ');
      std::string host;
      int port = 0;
      if (parse_endpoint(err.substr(sp + 1), &host, &port)) {
        Node* target = node(host, port);
        if (err[0] == 'M') {
          slots_[redis_cluster_slot(names[i])] = target;
          refresh_needed_ = true;
        } else {
          (*ask)[i] = target;
        }
        retry->push_back(i);
        return;
      }
    }
    (*results)[i] = {ObjectResult::kFailed, err};
  }

  // What a non-error reply to `op` on `name` (key i) means; a GET's verified payload is copied
  // into the pieces `into` gives for it (on_verified is the caller's, after the batch).
  KeyResult result_of(Op op, const redisReply& r, const std::string& name, std::size_t i, const ReadInto* into) const {
    switch (op) {
      case Op::kGet: {
        if (r.type == REDIS_REPLY_NIL) return {ObjectResult::kMissing, {}};
        if (r.type != REDIS_REPLY_STRING || static_cast<std::size_t>(r.len) != sizeof(ObjectHeader) + o_.store.object_bytes)
          return {ObjectResult::kCorrupt, {}};  // truncated, padded or not ours
        ObjectHeader h{};
        std::memcpy(&h, r.str, sizeof h);
        std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(r.str) + sizeof h, o_.store.object_bytes);
        if (const auto verdict = verify_object(o_.store, name.substr(5), h, payload); verdict != ObjectResult::kOk)
          return {verdict, {}};
        return detail::land(i, into->pieces(i), payload);  // on_verified: by read(), outside the lock
      }
      case Op::kExists:
        return {r.type == REDIS_REPLY_INTEGER && r.integer > 0 ? ObjectResult::kOk : ObjectResult::kMissing, {}};
      case Op::kSet:
      case Op::kDel: return {ObjectResult::kOk, {}};
    }
    return {ObjectResult::kFailed, "unknown operation"};
  }

  void fail_connection(Node& n) REQUIRES(mu_) {
    failure_ = n.ctx && n.ctx->errstr[0] ? n.ctx->errstr : "connection lost";
    n.failure = failure_;
    n.drop();
    n.backoff_ms = 50;
    n.retry_at = Clock::now() + std::chrono::milliseconds(n.backoff_ms);
    if (o_.cluster) refresh_needed_ = true;
  }

  RedisStoreOptions o_;
  std::string password_;
  mutable Mutex mu_;  // held for a whole command: one connection per node, used by one thread at a time
  std::map<std::string, std::unique_ptr<Node>> nodes_ GUARDED_BY(mu_);
  std::array<Node*, 16384> slots_ GUARDED_BY(mu_){};
  bool refresh_needed_ GUARDED_BY(mu_) = false;
  bool detect_pending_ GUARDED_BY(mu_) = false;  // no endpoint answered CLUSTER INFO yet
  // The latest connection failure in words, read by the call holding mu_ that met it (its keys'
  // errors, a node's backoff reason).
  std::string failure_ GUARDED_BY(mu_);
  detail::Counters counters_;
};

}  // namespace

Result<std::unique_ptr<ObjectStore>, StorageErrc> open_redis_store(const RedisStoreOptions& o) {
  if (o.store.object_bytes == 0) return make_error(StorageErrc::kInvalidArgument, "object_bytes must be positive");
  if (!proto::valid_model_id(o.store.model_id))
    return make_error(StorageErrc::kInvalidArgument, "model id '" + o.store.model_id + "' must be 1-64 of [A-Za-z0-9_.-]");
  // Two stores, each with its own connection per server: loads and queries never queue behind a
  // slow write on a shared connection (Redis answers one connection's commands in order).
  auto reads = std::make_unique<RedisStore>(o);
  KVTD_TRY(reads->init());
  auto writes = std::make_unique<RedisStore>(o);
  KVTD_TRY(writes->init());
  return detail::split_reads_and_writes(std::move(reads), std::move(writes));
}

}  // namespace kvtd::storage
