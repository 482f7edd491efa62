// One step of the Redis store's garbage collection on one server: SCAN (never KEYS, which
// blocks the server for the whole keyspace), then of what is not kept: GETRANGE of its header
// (only objects kvtd wrote go), STRLEN and UNLINK, pipelined.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvtd/storage/object_format.h"
#include "kvtd/storage/object_name.h"
#include "redis_support.h"

namespace kvtd::storage::detail {

std::optional<unsigned long long> gc_scan_step(redisContext* c, unsigned long long cursor, const GcRequest& request,
                                               const std::string& own_model, GcReport* report, std::string* error) {
  Reply r(static_cast<redisReply*>(redisCommand(c, "SCAN %llu MATCH kvtd:* COUNT 512", cursor)));
  if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
      r->element[1]->type != REDIS_REPLY_ARRAY) {
    *error = r && r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "no SCAN reply";
    return std::nullopt;
  }
  const unsigned long long next = std::strtoull(r->element[0]->str, nullptr, 10);
  std::vector<std::string> doomed;
  const redisReply* keys = r->element[1];
  for (std::size_t i = 0; i < keys->elements; ++i) {
    const std::string key(keys->element[i]->str, keys->element[i]->len);
    // "kvtd:" + an object name: anything else under kvtd: is not ours to judge.
    const auto object = ObjectName::parse(std::string_view(key).substr(5));
    if (!object) continue;
    ++report->examined;
    if (gc_keeps(request, own_model, *object))
      ++report->kept;
    else
      doomed.push_back(key);
  }
  // Only what kvtd wrote under its key goes: a key that merely looks like an object's stays.
  for (const auto& k : doomed)
    redisAppendCommand(c, "GETRANGE %b 0 %d", k.data(), k.size(), static_cast<int>(sizeof(ObjectHeader) - 1));
  std::vector<std::string> ours;
  for (const auto& k : doomed) {
    void* raw = nullptr;
    if (redisGetReply(c, &raw) != REDIS_OK) {
      *error = c->errstr[0] ? c->errstr : "connection lost";
      return std::nullopt;
    }
    Reply one(static_cast<redisReply*>(raw));
    ObjectHeader h{};
    const bool whole = one->type == REDIS_REPLY_STRING && one->len == sizeof h;
    if (whole) std::memcpy(&h, one->str, sizeof h);
    if (whole && written_by_kvtd(h, k.substr(5))) ours.push_back(k);
    else ++report->foreign;
  }
  doomed = std::move(ours);
  for (const auto& k : doomed) redisAppendCommand(c, "STRLEN %b", k.data(), k.size());
  if (!request.dry_run)
    for (const auto& k : doomed) redisAppendCommand(c, "UNLINK %b", k.data(), k.size());
  std::vector<long long> bytes(doomed.size(), 0);
  for (std::size_t i = 0; i < doomed.size() * (request.dry_run ? 1 : 2); ++i) {
    void* raw = nullptr;
    if (redisGetReply(c, &raw) != REDIS_OK) {
      *error = c->errstr[0] ? c->errstr : "connection lost";
      return std::nullopt;
    }
    Reply one(static_cast<redisReply*>(raw));
    const bool integer = one->type == REDIS_REPLY_INTEGER;
    if (i < doomed.size()) {
      bytes[i] = integer ? one->integer : 0;
      if (request.dry_run) {
        ++report->removed;
        report->removed_bytes += static_cast<std::uint64_t>(bytes[i]);
      }
    } else if (integer && one->integer == 1) {
      ++report->removed;
      const std::string& key = doomed[i - doomed.size()];
      report->removed_bytes += static_cast<std::uint64_t>(bytes[i - doomed.size()]);
      if (request.on_removed)
        if (const auto object = ObjectName::parse(std::string_view(key).substr(5)))
          request.on_removed(object->model, object->name);
    } else if (!integer) {
      ++report->failed;  // e.g. MOVED: the slot moved during the walk
      *error = one->type == REDIS_REPLY_ERROR ? std::string(one->str, one->len) : "unexpected UNLINK reply";
      if (report->first_failure.empty()) report->first_failure = "UNLINK " + doomed[i - doomed.size()] + ": " + *error;
    }  // 0: gone already (expired, or removed by another collector)
  }
  return next;
}

}  // namespace kvtd::storage::detail
