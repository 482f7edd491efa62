// kvtd/metrics/registry.h - the daemon's counters, histograms and gauges, and their Prometheus
// text exposition.
//
// Recording is lock-free (relaxed atomics: each value is independent, a scrape may see one task
// counted and its bytes not yet; the next scrape sees both), so the task path pays a few atomic
// adds. Rendering reads every atomic once; the storage store's own counters and the ring depth
// come from providers set by the daemon.
//
// Ownership: the daemon owns one MetricsRegistry for its whole life; the runner and the HTTP
// server borrow it. Not copyable or movable.
// Thread-safety: every method may be called from any thread; set_* providers before serving.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/proto/task.h"

namespace kvtd::metrics {

enum class Direction { kToHost = 0, kToDevice = 1, kStorageRead = 2, kStorageWrite = 3 };

// Cumulative histogram buckets in seconds (upper bounds), shared by queue wait and run time.
inline constexpr std::array<double, 14> kBucketsS = {1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3,
                                                     5e-3, 1e-2, 5e-2, 1e-1, 5e-1, 1.0,  5.0};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // One completed task (any rank-side outcome): its kind, status, the bytes it moved in
  // `direction`, its queue wait (engine submit to start) and run time.
  void task_done(proto::TaskKind kind, proto::TaskStatus status, Direction direction, std::uint64_t bytes,
                 std::int64_t queue_wait_ns, std::int64_t run_ns);

  void set_attached(bool attached, std::uint32_t epoch);
  void set_host_pool_bytes(std::uint64_t bytes);
  // Pinning the host pool (cudaHostRegister, in the background after its first blocks): bytes
  // pinned so far and milliseconds spent (the whole time once every byte is pinned).
  void set_host_pool_pinning(std::uint64_t pinned_bytes, std::uint64_t ms);
  // A swap that waited `ns` for its host blocks to be pinned.
  void host_pool_pin_wait(std::int64_t ns);
  void set_ring_depth(std::uint64_t bytes);
  // A session with cache groups: each group's kind name and host pool bytes (empty: none, and
  // the per-group series are not exported). Set at each mapping of the cache.
  struct GroupFigures {
    std::string kind;
    std::uint64_t host_pool_bytes = 0;
  };
  void set_cache_groups(std::vector<GroupFigures> groups);
  // Bytes a swap moved of cache group `group`'s blocks (direction kToHost or kToDevice).
  void group_swap_bytes(std::uint32_t group, Direction d, std::uint64_t bytes);
  std::uint64_t group_swap_bytes(std::uint32_t group, Direction d) const;
  // Bytes storage tasks moved of cache group `group`'s objects (kStorageRead or kStorageWrite).
  void group_storage_bytes(std::uint32_t group, Direction d, std::uint64_t bytes);
  std::uint64_t group_storage_bytes(std::uint32_t group, Direction d) const;
  std::vector<GroupFigures> cache_groups() const;
  static constexpr std::uint32_t kMaxGroups = 8;  // proto::kMaxGroups
  // What the storage tier counted, for kvtd_storage_operations_total. The registry knows no store:
  // the daemon provides these figures (metrics/ does not depend on storage/).
  struct StoreFigures {
    std::uint64_t puts = 0, put_failures = 0, hits = 0, misses = 0, corrupt = 0, evictions = 0;
    bool sized = false;  // the store knows what it holds (file store): the two below are exported
    std::uint64_t bytes_stored = 0, objects_stored = 0;
  };
  using StoreFiguresProvider = std::function<StoreFigures()>;
  // Sets (or clears, with an empty function) the provider; whatever it reads must outlive every
  // render() (the daemon stops the server first).
  void set_store_figures(StoreFiguresProvider provider);
  // The tier label of the storage metrics ("file", "redis"); set once before serving.
  void set_store_tier(std::string tier);
  // What the KV-event publisher sent and dropped (rank 0 with --kv-events-endpoint), for
  // kvtd_kv_events_{sent,dropped}_total. Same lifetime rule as the store figures.
  struct KvEventFigures {
    std::uint64_t sent = 0, dropped = 0;
  };
  using KvEventFiguresProvider = std::function<KvEventFigures()>;
  void set_kv_event_figures(KvEventFiguresProvider provider);
  // A storage lookup's agreed outcome (STORAGE_QUERY, STORAGE_READ, PREFETCH): keys found in the
  // tier on every rank, and keys asked for and not found, for kvtd_storage_lookups_total.
  void storage_lookup(proto::TaskKind kind, std::uint64_t hits, std::uint64_t misses);
  // A storage task whose cross-rank agreement ended without agreeing, by the status it failed
  // with; `this_rank`: this rank aborted it (else a peer did, or the agreement itself failed).
  void agreement_failed(proto::TaskStatus cause, bool this_rank);
  // What the health probes conclude, for kvtd_ready and kvtd_store_up (alerts on a rank not
  // ready, a store not answering). Same lifetime rule as the store figures.
  struct HealthFigures {
    bool ready = false;
    bool has_store = false;
    bool store_up = false;
    double copy_running_s = 0;  // the oldest device copy still running, seconds (0: none)
  };
  using HealthFiguresProvider = std::function<HealthFigures()>;
  void set_health_figures(HealthFiguresProvider provider);

  // Prometheus text format 0.0.4.
  std::string render() const;

  // For `kvtd ctl status`: the non-zero task counters, bytes by direction, the gauges, and the
  // last few failure messages (note_error keeps the newest kLastErrors).
  struct TaskCount {
    proto::TaskKind kind;
    proto::TaskStatus status;
    std::uint64_t count;
  };
  std::vector<TaskCount> task_counts() const;
  std::uint64_t bytes(Direction d) const { return bytes_[static_cast<std::size_t>(d)].load(std::memory_order_relaxed); }
  std::uint64_t ring_depth() const { return ring_depth_.load(std::memory_order_relaxed); }
  std::uint32_t epoch() const { return epoch_.load(std::memory_order_relaxed); }
  bool attached() const { return attached_.load(std::memory_order_relaxed) != 0; }
  std::uint64_t host_pool_bytes() const { return host_pool_bytes_.load(std::memory_order_relaxed); }
  std::uint64_t host_pool_pin_ms() const { return host_pool_pin_ms_.load(std::memory_order_relaxed); }
  std::uint64_t host_pool_pinned_bytes() const { return host_pool_pinned_bytes_.load(std::memory_order_relaxed); }
  std::uint64_t host_pool_pin_waits() const { return host_pool_pin_waits_.load(std::memory_order_relaxed); }
  static constexpr std::size_t kLastErrors = 8;
  void note_error(std::string message);
  std::vector<std::string> last_errors() const;

 private:
  static constexpr int kKinds = static_cast<int>(proto::kMaxTaskKind) + 1;
  static constexpr int kStatuses = 32;
  static constexpr int kBuckets = static_cast<int>(kBucketsS.size());
  struct Histogram {
    std::array<std::atomic<std::uint64_t>, kBuckets> buckets{};  // per bucket (not cumulative)
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::uint64_t> sum_ns{0};
    void observe(std::int64_t ns);
  };
  std::array<std::array<std::atomic<std::uint64_t>, kStatuses>, kKinds> tasks_{};
  std::array<std::atomic<std::uint64_t>, 4> bytes_{};
  std::array<Histogram, kKinds> queue_wait_{};
  std::array<Histogram, kKinds> run_time_{};
  std::atomic<std::uint32_t> attached_{0};
  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::uint64_t> host_pool_bytes_{0};
  std::atomic<std::uint64_t> host_pool_pin_ms_{0};
  std::atomic<std::uint64_t> host_pool_pinned_bytes_{0};
  std::atomic<std::uint64_t> host_pool_pin_waits_{0};
  std::atomic<std::uint64_t> host_pool_pin_wait_ns_{0};
  std::atomic<std::uint64_t> ring_depth_{0};
  // [group][Direction]: swaps (to host, to device) and storage tasks (read, written).
  std::array<std::array<std::atomic<std::uint64_t>, 4>, kMaxGroups> group_bytes_{};
  std::vector<GroupFigures> groups_ GUARDED_BY(store_mu_);
  void render_groups(std::string& out) const;
  // [kind][0 hit, 1 miss] for the lookup kinds; [status][0 peer, 1 this rank].
  std::array<std::array<std::atomic<std::uint64_t>, 2>, kKinds> lookups_{};
  std::array<std::array<std::atomic<std::uint64_t>, 2>, kStatuses> agreement_failures_{};
  std::string tier_ GUARDED_BY(store_mu_) = "none";
  void render_health(std::string& out) const;
  void render_storage(std::string& out) const;
  mutable Mutex store_mu_;
  StoreFiguresProvider store_figures_ GUARDED_BY(store_mu_);
  HealthFiguresProvider health_figures_ GUARDED_BY(store_mu_);
  KvEventFiguresProvider kv_event_figures_ GUARDED_BY(store_mu_);
  mutable Mutex errors_mu_;
  std::vector<std::string> errors_ GUARDED_BY(errors_mu_);  // newest last, at most kLastErrors
};

}  // namespace kvtd::metrics
