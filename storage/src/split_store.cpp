#include "split_store.h"

#include <algorithm>
#include <atomic>
#include <type_traits>

namespace kvtd::storage::detail {
namespace {

class SplitStore final : public ObjectStore {
 public:
  SplitStore(std::unique_ptr<ObjectStore> reads, std::unique_ptr<ObjectStore> writes)
      : reads_(std::move(reads)), writes_(std::move(writes)) {}

  Result<std::size_t, StorageErrc> exists(std::span<const std::string> keys) override {
    return noted(reads_, reads_->exists(keys));
  }
  Result<std::vector<ObjectResult>, StorageErrc> get(std::span<const std::string> keys,
                                                     std::span<std::byte* const> dsts) override {
    return noted(reads_, reads_->get(keys, dsts));
  }
  Result<std::vector<ObjectResult>, StorageErrc> get_each(std::span<const std::string> keys,
                                                          std::span<std::byte* const> dsts,
                                                          const ObjectHook& on_ok) override {
    return noted(reads_, reads_->get_each(keys, dsts, on_ok));
  }
  bool lends_payloads() const override { return reads_->lends_payloads(); }
  Result<std::vector<ObjectResult>, StorageErrc> get_lent(std::span<const std::string> keys,
                                                          const LentHook& on_object) override {
    return noted(reads_, reads_->get_lent(keys, on_object));
  }
  bool reads_parts() const override { return reads_->reads_parts(); }
  Result<std::vector<ObjectResult>, StorageErrc> get_parts(std::span<const std::string> keys, const PartsOf& parts_of,
                                                           const ObjectHook& on_ok) override {
    return noted(reads_, reads_->get_parts(keys, parts_of, on_ok));
  }

  Result<std::vector<ObjectResult>, StorageErrc> put(std::span<const std::string> keys,
                                                     std::span<const std::byte* const> srcs) override {
    return noted(writes_, writes_->put(keys, srcs));
  }
  Result<std::vector<ObjectResult>, StorageErrc> put_each(std::span<const std::string> keys,
                                                          std::span<const std::byte* const> srcs,
                                                          const FillHook& before_put) override {
    return noted(writes_, writes_->put_each(keys, srcs, before_put));
  }
  bool writes_parts() const override { return writes_->writes_parts(); }
  Result<std::vector<ObjectResult>, StorageErrc> put_parts(std::span<const std::string> keys,
                                                           std::span<const Parts> objects) override {
    return noted(writes_, writes_->put_parts(keys, objects));
  }
  // Both sides see the same store: the write side walks it.
  Result<GcReport, StorageErrc> collect(const GcRequest& request) override { return writes_->collect(request); }

  Status<StorageErrc> remove(std::span<const std::string> keys) override {
    auto r = writes_->remove(keys);
    if (!r.ok()) last_failed_.store(writes_.get(), std::memory_order_relaxed);
    return r;
  }

  // Gets are counted where they ran, puts where they ran.
  StoreStats stats() const override {
    const StoreStats r = reads_->stats(), w = writes_->stats();
    StoreStats s;
    s.puts = w.puts;
    s.put_failures = w.put_failures;
    s.gets = r.gets;
    s.hits = r.hits;
    s.misses = r.misses;
    s.corrupt = r.corrupt;
    s.evictions = r.evictions + w.evictions;
    s.bytes_stored = std::max(r.bytes_stored, w.bytes_stored);
    s.objects_stored = std::max(r.objects_stored, w.objects_stored);
    s.sized = r.sized || w.sized;
    return s;
  }
  // The error of the side whose call failed last.
  std::string last_error() const override {
    const ObjectStore* side = last_failed_.load(std::memory_order_relaxed);
    return (side != nullptr ? side : writes_.get())->last_error();
  }

 private:
  // Remembers `side` as the last to fail when `r` failed or holds a failed object.
  template <typename R>
  R noted(const std::unique_ptr<ObjectStore>& side, R r) {
    bool failed = !r.ok();
    if constexpr (std::is_same_v<R, Result<std::vector<ObjectResult>, StorageErrc>>) {
      if (r.ok())
        for (auto x : *r) failed = failed || x == ObjectResult::kFailed;
    }
    if (failed) last_failed_.store(side.get(), std::memory_order_relaxed);
    return r;
  }

  std::unique_ptr<ObjectStore> reads_, writes_;
  std::atomic<const ObjectStore*> last_failed_{nullptr};
};

}  // namespace

std::unique_ptr<ObjectStore> split_reads_and_writes(std::unique_ptr<ObjectStore> reads,
                                                    std::unique_ptr<ObjectStore> writes) {
  return std::make_unique<SplitStore>(std::move(reads), std::move(writes));
}

}  // namespace kvtd::storage::detail
