#include "split_store.h"

#include <algorithm>

namespace kvtd::storage::detail {
namespace {

class SplitStore final : public ObjectStore {
 public:
  SplitStore(std::unique_ptr<ObjectStore> reads, std::unique_ptr<ObjectStore> writes)
      : reads_(std::move(reads)), writes_(std::move(writes)) {}

  // What each side does: reads on one, writes on the other.
  StoreCapabilities capabilities() const override {
    return {.reads_in_place = reads_->capabilities().reads_in_place,
            .writes_pieces = writes_->capabilities().writes_pieces};
  }
  Result<std::size_t, StorageErrc> exists(std::span<const std::string> keys) override { return reads_->exists(keys); }
  BatchResult read(std::span<const std::string> keys, const ReadInto& into) override { return reads_->read(keys, into); }
  BatchResult write(std::span<const std::string> keys, const WriteFrom& from) override {
    return writes_->write(keys, from);
  }
  // Both sides see the same store: the write side walks it.
  Result<GcReport, StorageErrc> collect(const GcRequest& request) override { return writes_->collect(request); }
  Status<StorageErrc> remove(std::span<const std::string> keys) override { return writes_->remove(keys); }

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
 private:
  std::unique_ptr<ObjectStore> reads_, writes_;
};

}  // namespace

std::unique_ptr<ObjectStore> split_reads_and_writes(std::unique_ptr<ObjectStore> reads,
                                                    std::unique_ptr<ObjectStore> writes) {
  return std::make_unique<SplitStore>(std::move(reads), std::move(writes));
}

}  // namespace kvtd::storage::detail
