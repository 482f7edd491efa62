// The one in-memory ObjectStore of the tests: every executor and task test that needs a store it
// can script uses this one. It declares whichever capabilities the test gives it, so each read
// and write path of a caller runs against it (in place or through verified copies; pieces
// written as given), and its failures, losses, corruption and pauses are scripted per key.
//
// Thread-safety: every ObjectStore method may be called from several threads. The script (the
// public fields) is set by the test while no call of the store is running (before the tasks
// that meet it are submitted); size() and stored() may be called at any time.
#pragma once

#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "kvtd/storage/object_store.h"

namespace kvtd::test {

class ScriptedStore final : public storage::ObjectStore {
 public:
  explicit ScriptedStore(std::size_t object_bytes, storage::StoreCapabilities capabilities = {})
      : bytes_(object_bytes), capabilities_(capabilities) {}

  // Present for exists(), but a read fails with `cause` (a server gone).
  std::map<std::string, std::string> fail_on_read;
  std::set<std::string> vanish_on_read;   // present for exists(), missing for a read (evicted between)
  std::set<std::string> corrupt_on_read;  // present, but its bytes fail verification
  std::map<std::string, std::string> fail_on_write;  // a write of the key fails with this cause
  std::function<void()> on_write;                    // runs inside every write() (a slow store)

  storage::StoreCapabilities capabilities() const override { return capabilities_; }

  Result<std::size_t, storage::StorageErrc> exists(std::span<const std::string> keys) override {
    std::lock_guard<std::mutex> g(mu_);
    std::size_t n = 0;
    while (n < keys.size() && (objects_.count(keys[n]) != 0 || fail_on_read.count(keys[n]) != 0 ||
                               vanish_on_read.count(keys[n]) != 0))
      ++n;
    return n;
  }

  storage::BatchResult read(std::span<const std::string> keys, const storage::ReadInto& into) override {
    std::vector<storage::KeyResult> out(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      out[i] = read_one(keys[i], into.pieces(i), into.unverified_bytes_ok && capabilities_.reads_in_place);
      if (out[i].ok() && into.on_verified) into.on_verified(i);
    }
    return out;
  }

  storage::BatchResult write(std::span<const std::string> keys, const storage::WriteFrom& from) override {
    if (on_write) on_write();
    std::vector<storage::KeyResult> out(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto pieces = from.pieces(i);
      if (!pieces) {
        out[i] = {storage::ObjectResult::kFailed, "not written: " + from.refused};
        continue;
      }
      std::vector<std::byte> object;
      for (auto piece : *pieces) object.insert(object.end(), piece.begin(), piece.end());
      std::lock_guard<std::mutex> g(mu_);
      if (auto f = fail_on_write.find(keys[i]); f != fail_on_write.end()) {
        out[i] = {storage::ObjectResult::kFailed, "write " + keys[i] + ": " + f->second};
      } else if (object.size() != bytes_) {
        out[i] = {storage::ObjectResult::kFailed, fmt::format("pieces hold {} bytes", object.size())};
      } else {
        objects_[keys[i]] = std::move(object);
        out[i] = {storage::ObjectResult::kOk, {}};
      }
    }
    return out;
  }

  Status<storage::StorageErrc> remove(std::span<const std::string> keys) override {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& k : keys) objects_.erase(k);
    return {};
  }
  Result<storage::GcReport, storage::StorageErrc> collect(const storage::GcRequest&) override {
    return make_error(storage::StorageErrc::kInvalidArgument, "the scripted store does not collect garbage");
  }
  storage::StoreStats stats() const override { return {}; }

  std::size_t size() const {
    std::lock_guard<std::mutex> g(mu_);
    return objects_.size();
  }
  // The stored bytes of `key` (empty if none).
  std::vector<std::byte> stored(const std::string& key) const {
    std::lock_guard<std::mutex> g(mu_);
    auto it = objects_.find(key);
    return it == objects_.end() ? std::vector<std::byte>{} : it->second;
  }

 private:
  // In place, the bytes land before verification (a corrupt object's too, flipped); otherwise
  // only verified bytes are copied in.
  storage::KeyResult read_one(const std::string& key, const storage::Pieces& pieces, bool in_place) {
    std::lock_guard<std::mutex> g(mu_);
    if (auto f = fail_on_read.find(key); f != fail_on_read.end())
      return {storage::ObjectResult::kFailed, "read " + key + ": " + f->second};
    auto it = objects_.find(key);
    if (it == objects_.end()) return {storage::ObjectResult::kMissing, {}};
    std::size_t total = 0;
    for (auto piece : pieces) total += piece.size();
    if (total != bytes_) return {storage::ObjectResult::kFailed, fmt::format("pieces hold {} bytes", total)};
    const bool corrupt = corrupt_on_read.count(key) != 0;
    if (corrupt && !in_place) return {storage::ObjectResult::kCorrupt, {}};
    std::size_t at = 0;
    for (auto piece : pieces) {
      std::memcpy(piece.data(), it->second.data() + at, piece.size());
      if (corrupt) piece[0] = ~piece[0];
      at += piece.size();
    }
    return {corrupt ? storage::ObjectResult::kCorrupt : storage::ObjectResult::kOk, {}};
  }

  const std::size_t bytes_;
  const storage::StoreCapabilities capabilities_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<std::byte>> objects_;  // guarded by mu_
};

}  // namespace kvtd::test
