#include "kvtd/base/mutex.h"
#include "kvtd/metrics/registry.h"
#include "exposition_line.h"

#include <algorithm>
#include <cstdio>

namespace kvtd::metrics {
namespace {

const char* direction_name(int d) {
  switch (d) {
    case 0: return "to_host";
    case 1: return "to_device";
    case 2: return "storage_read";
    default: return "storage_write";
  }
}

using detail::line;

}  // namespace

void MetricsRegistry::Histogram::observe(std::int64_t ns) {
  if (ns < 0) ns = 0;
  const double s = static_cast<double>(ns) / 1e9;
  int b = 0;
  while (b < kBuckets && s > kBucketsS[static_cast<std::size_t>(b)]) ++b;
  if (b < kBuckets) buckets[static_cast<std::size_t>(b)].fetch_add(1, std::memory_order_relaxed);
  count.fetch_add(1, std::memory_order_relaxed);
  sum_ns.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
}

void MetricsRegistry::task_done(proto::TaskKind kind, proto::TaskStatus status, Direction direction,
                                std::uint64_t bytes, std::int64_t queue_wait_ns, std::int64_t run_ns) {
  const auto k = static_cast<std::size_t>(kind);
  const auto st = static_cast<std::size_t>(status);
  if (k >= kKinds || st >= kStatuses) return;  // a kind or status this build does not know
  tasks_[k][st].fetch_add(1, std::memory_order_relaxed);
  if (bytes != 0) bytes_[static_cast<std::size_t>(direction)].fetch_add(bytes, std::memory_order_relaxed);
  queue_wait_[k].observe(queue_wait_ns);
  run_time_[k].observe(run_ns);
}

void MetricsRegistry::set_attached(bool attached, std::uint32_t epoch) {
  attached_.store(attached ? 1 : 0, std::memory_order_relaxed);
  epoch_.store(epoch, std::memory_order_relaxed);
}
void MetricsRegistry::set_host_pool_bytes(std::uint64_t bytes) { host_pool_bytes_.store(bytes, std::memory_order_relaxed); }
void MetricsRegistry::set_host_pool_pinning(std::uint64_t pinned_bytes, std::uint64_t ms) {
  host_pool_pinned_bytes_.store(pinned_bytes, std::memory_order_relaxed);
  host_pool_pin_ms_.store(ms, std::memory_order_relaxed);
}

void MetricsRegistry::host_pool_pin_wait(std::int64_t ns) {
  host_pool_pin_waits_.fetch_add(1, std::memory_order_relaxed);
  host_pool_pin_wait_ns_.fetch_add(static_cast<std::uint64_t>(std::max<std::int64_t>(ns, 0)), std::memory_order_relaxed);
}
void MetricsRegistry::set_ring_depth(std::uint64_t bytes) { ring_depth_.store(bytes, std::memory_order_relaxed); }
void MetricsRegistry::set_store_figures(StoreFiguresProvider provider) {
  MutexLock g(store_mu_);
  store_figures_ = std::move(provider);
}

void MetricsRegistry::set_health_figures(HealthFiguresProvider provider) {
  MutexLock g(store_mu_);
  health_figures_ = std::move(provider);
}

std::vector<MetricsRegistry::TaskCount> MetricsRegistry::task_counts() const {
  std::vector<TaskCount> out;
  for (int k = 1; k < kKinds; ++k)
    for (int s = 0; s < kStatuses; ++s)
      if (const auto v = tasks_[static_cast<std::size_t>(k)][static_cast<std::size_t>(s)].load(std::memory_order_relaxed))
        out.push_back({static_cast<proto::TaskKind>(k), static_cast<proto::TaskStatus>(s), v});
  return out;
}

void MetricsRegistry::note_error(std::string message) {
  MutexLock g(errors_mu_);
  if (errors_.size() == kLastErrors) errors_.erase(errors_.begin());
  errors_.push_back(std::move(message));
}

std::vector<std::string> MetricsRegistry::last_errors() const {
  MutexLock g(errors_mu_);
  return errors_;
}

void MetricsRegistry::render_health(std::string& out) const {
  HealthFiguresProvider health;
  {
    MutexLock g(store_mu_);
    health = health_figures_;
  }
  if (!health) return;
  const HealthFigures h = health();
  line(out, "# HELP kvtd_ready 1 while this rank can serve (what /readyz answers).\n# TYPE kvtd_ready gauge\nkvtd_ready %d\n",
       h.ready ? 1 : 0);
  line(out,
       "# HELP kvtd_copy_running_seconds Seconds the oldest running device copy has run (0: none).\n# TYPE kvtd_copy_running_seconds gauge\nkvtd_copy_running_seconds %.3f\n",
       h.copy_running_s);
  if (h.has_store)
    line(out,
         "# HELP kvtd_store_up 1 while the storage tier answers this rank's probe.\n# TYPE kvtd_store_up gauge\n"
         "kvtd_store_up %d\n",
         h.store_up ? 1 : 0);
}

std::string MetricsRegistry::render() const {
  std::string out;
  out.reserve(16384);
  out += "# HELP kvtd_tasks_total Tasks this rank completed, by kind and status.\n# TYPE kvtd_tasks_total counter\n";
  for (int k = 1; k < kKinds; ++k)
    for (int s = 0; s < kStatuses; ++s) {
      const auto v = tasks_[static_cast<std::size_t>(k)][static_cast<std::size_t>(s)].load(std::memory_order_relaxed);
      const char* status = proto::task_status_name(static_cast<proto::TaskStatus>(s));
      // Every kind's ok series exists from the start (rates need a zero); others once seen.
      if (v == 0 && s != 0) continue;
      line(out, "kvtd_tasks_total{kind=\"%s\",status=\"%s\"} %llu\n",
           proto::task_kind_name(static_cast<proto::TaskKind>(k)), status, static_cast<unsigned long long>(v));
    }
  out += "# HELP kvtd_bytes_total Bytes this rank moved, by direction.\n# TYPE kvtd_bytes_total counter\n";
  for (int d = 0; d < 4; ++d)
    line(out, "kvtd_bytes_total{direction=\"%s\"} %llu\n", direction_name(d),
         static_cast<unsigned long long>(bytes_[static_cast<std::size_t>(d)].load(std::memory_order_relaxed)));
  const struct {
    const char* name;
    const char* help;
    const std::array<Histogram, kKinds>* h;
  } hists[] = {{"kvtd_task_queue_seconds", "Time from the engine's submit to the start of execution.", &queue_wait_},
               {"kvtd_task_seconds", "Execution time of a task on this rank.", &run_time_}};
  for (const auto& hist : hists) {
    line(out, "# HELP %s %s\n# TYPE %s histogram\n", hist.name, hist.help, hist.name);
    for (int k = 1; k < kKinds; ++k) {
      const auto& h = (*hist.h)[static_cast<std::size_t>(k)];
      const char* kind = proto::task_kind_name(static_cast<proto::TaskKind>(k));
      std::uint64_t cumulative = 0;
      for (int b = 0; b < kBuckets; ++b) {
        cumulative += h.buckets[static_cast<std::size_t>(b)].load(std::memory_order_relaxed);
        line(out, "%s_bucket{kind=\"%s\",le=\"%g\"} %llu\n", hist.name, kind, kBucketsS[static_cast<std::size_t>(b)],
             static_cast<unsigned long long>(cumulative));
      }
      // +Inf from the same read of count, so the series stays monotonic within one scrape.
      const std::uint64_t count = std::max(cumulative, h.count.load(std::memory_order_relaxed));
      line(out, "%s_bucket{kind=\"%s\",le=\"+Inf\"} %llu\n", hist.name, kind, static_cast<unsigned long long>(count));
      line(out, "%s_sum{kind=\"%s\"} %.9f\n", hist.name, kind,
           static_cast<double>(h.sum_ns.load(std::memory_order_relaxed)) / 1e9);
      line(out, "%s_count{kind=\"%s\"} %llu\n", hist.name, kind, static_cast<unsigned long long>(count));
    }
  }
  render_storage(out);
  render_groups(out);
  const struct {
    const char* name;
    const char* help;
    unsigned long long v;
  } gauges[] = {
      {"kvtd_ring_depth_bytes", "Task ring bytes published and not yet read by this rank.",
       ring_depth_.load(std::memory_order_relaxed)},
      {"kvtd_attached", "1 while this rank is attached to an engine session.", attached_.load(std::memory_order_relaxed)},
      {"kvtd_epoch", "The epoch the engine granted this rank (0: none).", epoch_.load(std::memory_order_relaxed)},
      {"kvtd_host_pool_bytes", "Bytes of this rank's host pool.", host_pool_bytes_.load(std::memory_order_relaxed)},
      {"kvtd_host_pool_pinned_bytes", "Bytes of the host pool pinned for DMA so far (pinning goes on in the background).",
       host_pool_pinned_bytes_.load(std::memory_order_relaxed)},
  };
  for (const auto& g : gauges) line(out, "# HELP %s %s\n# TYPE %s gauge\n%s %llu\n", g.name, g.help, g.name, g.name, g.v);
  render_health(out);
  line(out,
       "# HELP kvtd_host_pool_pin_seconds Seconds spent pinning the host pool for DMA (so far, while it goes on).\n"
       "# TYPE kvtd_host_pool_pin_seconds gauge\nkvtd_host_pool_pin_seconds %.3f\n",
       static_cast<double>(host_pool_pin_ms_.load(std::memory_order_relaxed)) / 1000.0);
  line(out,
       "# HELP kvtd_host_pool_pin_waits_total Swaps that waited for their host blocks to be pinned.\n"
       "# TYPE kvtd_host_pool_pin_waits_total counter\nkvtd_host_pool_pin_waits_total %llu\n",
       static_cast<unsigned long long>(host_pool_pin_waits_.load(std::memory_order_relaxed)));
  line(out,
       "# HELP kvtd_host_pool_pin_wait_seconds_total Seconds swaps waited for their host blocks to be pinned.\n"
       "# TYPE kvtd_host_pool_pin_wait_seconds_total counter\nkvtd_host_pool_pin_wait_seconds_total %.6f\n",
       static_cast<double>(host_pool_pin_wait_ns_.load(std::memory_order_relaxed)) / 1e9);
  return out;
}

}  // namespace kvtd::metrics
