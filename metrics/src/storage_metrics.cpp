// The storage tier's figures: the store's own operation counters and size (from the daemon's
// provider), the agreed lookups and the failed agreements (recorded by the storage executor).
#include <cstdio>

#include "kvtd/base/mutex.h"
#include "kvtd/metrics/registry.h"
#include "exposition_line.h"

namespace kvtd::metrics {
namespace {

using detail::line;

constexpr proto::TaskKind kLookupKinds[] = {proto::TaskKind::kStorageQuery, proto::TaskKind::kStorageRead,
                                            proto::TaskKind::kPrefetch};

void render_store_figures(std::string& out, const MetricsRegistry::StoreFigures& st, const char* tier) {
  const struct {
    const char* op;
    const char* result;
    std::uint64_t v;
  } ops[] = {{"put", "ok", st.puts >= st.put_failures ? st.puts - st.put_failures : 0},
             {"put", "error", st.put_failures},
             {"get", "hit", st.hits},
             {"get", "miss", st.misses},
             {"get", "corrupt", st.corrupt},
             {"evict", "ok", st.evictions}};
  for (const auto& o : ops)
    line(out, "kvtd_storage_operations_total{tier=\"%s\",op=\"%s\",result=\"%s\"} %llu\n", tier, o.op, o.result,
         static_cast<unsigned long long>(o.v));
  if (!st.sized) return;
  line(out, "# HELP kvtd_store_bytes Bytes of objects this rank's store holds under its namespace.\n"
            "# TYPE kvtd_store_bytes gauge\nkvtd_store_bytes{tier=\"%s\"} %llu\n",
       tier, static_cast<unsigned long long>(st.bytes_stored));
  line(out, "# HELP kvtd_store_objects Objects this rank's store holds under its namespace.\n"
            "# TYPE kvtd_store_objects gauge\nkvtd_store_objects{tier=\"%s\"} %llu\n",
       tier, static_cast<unsigned long long>(st.objects_stored));
}

}  // namespace

void MetricsRegistry::set_store_tier(std::string tier) {
  MutexLock g(store_mu_);
  tier_ = std::move(tier);
}

void MetricsRegistry::set_kv_event_figures(KvEventFiguresProvider provider) {
  MutexLock g(store_mu_);
  kv_event_figures_ = std::move(provider);
}

void MetricsRegistry::storage_lookup(proto::TaskKind kind, std::uint64_t hits, std::uint64_t misses) {
  const auto k = static_cast<std::size_t>(kind);
  if (k >= lookups_.size()) return;
  lookups_[k][0].fetch_add(hits, std::memory_order_relaxed);
  lookups_[k][1].fetch_add(misses, std::memory_order_relaxed);
}

void MetricsRegistry::agreement_failed(proto::TaskStatus cause, bool this_rank) {
  const auto s = static_cast<std::size_t>(cause);
  if (s >= agreement_failures_.size()) return;
  agreement_failures_[s][this_rank ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
}

void MetricsRegistry::render_storage(std::string& out) const {
  StoreFiguresProvider figures;
  KvEventFiguresProvider events;
  std::string tier;
  {
    MutexLock g(store_mu_);
    figures = store_figures_;
    events = kv_event_figures_;
    tier = tier_;
  }
  if (events) {
    const auto e = events();
    line(out, "# HELP kvtd_kv_events_sent_total KV events for routers sent on the PUB socket.\n"
              "# TYPE kvtd_kv_events_sent_total counter\nkvtd_kv_events_sent_total %llu\n",
         static_cast<unsigned long long>(e.sent));
    line(out, "# HELP kvtd_kv_events_dropped_total KV events dropped: the queue was full or the socket refused them.\n"
              "# TYPE kvtd_kv_events_dropped_total counter\nkvtd_kv_events_dropped_total %llu\n",
         static_cast<unsigned long long>(e.dropped));
  }
  out += "# HELP kvtd_storage_operations_total Operations of the storage tier, by tier, operation and result.\n"
         "# TYPE kvtd_storage_operations_total counter\n";
  if (figures) render_store_figures(out, figures(), tier.c_str());
  out += "# HELP kvtd_storage_lookups_total Keys storage lookups asked for, by task kind, tier and agreed result "
         "(hit: stored on every rank).\n# TYPE kvtd_storage_lookups_total counter\n";
  for (auto kind : kLookupKinds)
    for (int r = 0; r < 2; ++r)
      line(out, "kvtd_storage_lookups_total{kind=\"%s\",tier=\"%s\",result=\"%s\"} %llu\n", proto::task_kind_name(kind),
           tier.c_str(), r == 0 ? "hit" : "miss",
           static_cast<unsigned long long>(
               lookups_[static_cast<std::size_t>(kind)][static_cast<std::size_t>(r)].load(std::memory_order_relaxed)));
  out += "# HELP kvtd_agreement_failures_total Storage tasks whose cross-rank agreement ended without agreeing, by "
         "cause and by whom (this_rank: this rank aborted it; peer: another rank did, or the agreement failed).\n"
         "# TYPE kvtd_agreement_failures_total counter\n";
  for (int s = 0; s < kStatuses; ++s)
    for (int by = 0; by < 2; ++by) {
      const auto v = agreement_failures_[static_cast<std::size_t>(s)][static_cast<std::size_t>(by)].load(
          std::memory_order_relaxed);
      if (v == 0) continue;
      line(out, "kvtd_agreement_failures_total{cause=\"%s\",by=\"%s\"} %llu\n",
           proto::task_status_name(static_cast<proto::TaskStatus>(s)), by == 1 ? "this_rank" : "peer",
           static_cast<unsigned long long>(v));
    }
}

}  // namespace kvtd::metrics
