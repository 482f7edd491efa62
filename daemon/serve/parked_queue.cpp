#include "parked_queue.h"

namespace kvtd::daemon {

ParkedQueue::ParkedQueue(std::int64_t host_blocks, std::int64_t device_blocks)
    : parked_(host_blocks, device_blocks), ahead_(host_blocks, device_blocks) {}

bool ParkedQueue::must_wait(const Work& w) const {
  if (entries_.empty()) return false;
  if (w.storage && storage_parked_ != 0) return true;
  if (w.header.after_task_id != 0 && ids_.count(w.header.after_task_id) != 0) return true;
  return parked_.collides(tracked_task(w));
}

void ParkedQueue::park(Work&& w, Lane lane) {
  entries_.push_back(Entry{std::move(w), lane});
  const Entry& e = entries_.back();  // the views below point into the listed copy
  parked_.add(tracked_task(e.work));
  ids_.insert(e.work.header.task_id);
  if (e.work.storage) ++storage_parked_;
}

void ParkedQueue::forget(const Entry& e) {
  parked_.remove(tracked_task(e.work));
  ids_.erase(e.work.header.task_id);
  if (e.work.storage) --storage_parked_;
}

std::size_t ParkedQueue::release_ready(const TryAdmit& try_admit, const Go& go) {
  std::size_t went = 0;
  bool storage_ahead = false;
  std::unordered_set<std::uint64_t> ids_ahead;
  std::vector<const Entry*> kept;  // in ahead_, taken out again before returning
  for (auto it = entries_.begin(); it != entries_.end();) {
    const auto t = tracked_task(it->work);
    const bool held = (it->work.storage && storage_ahead) || (t.after_task_id != 0 && ids_ahead.count(t.after_task_id)) ||
                      ahead_.collides(t) || !try_admit(it->work, it->lane);
    if (held) {
      ahead_.add(t);
      kept.push_back(&*it);
      ids_ahead.insert(t.task_id);
      storage_ahead = storage_ahead || it->work.storage;
      ++it;
      continue;
    }
    forget(*it);
    Entry e = std::move(*it);
    it = entries_.erase(it);
    go(std::move(e.work), e.lane);
    ++went;
  }
  for (const Entry* e : kept) ahead_.remove(tracked_task(e->work));
  return went;
}

std::optional<proto::TaskRecordHeader> ParkedQueue::cancel(std::uint64_t task_id) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    Work& w = it->work;
    if (w.header.task_id != task_id) continue;
    const proto::TaskRecordHeader header = w.header;
    if (!w.storage) {
      forget(*it);
      entries_.erase(it);
      return header;
    }
    if (w.storage_work.answered) return std::nullopt;  // cancelled before: nothing left to stop
    parked_.remove(tracked_task(w));
    w.host_ids.clear();
    w.device_ids.clear();
    w.header.after_task_id = 0;
    w.storage_work.blocks.clear();
    w.storage_work.header.after_task_id = 0;
    w.storage_work.answered = proto::TaskStatus::kCancelled;
    parked_.add(tracked_task(w));  // counts nothing now: kept balanced for forget()
    return header;
  }
  return std::nullopt;
}

std::vector<Work> ParkedQueue::take_all() {
  std::vector<Work> out;
  for (auto& e : entries_) {
    forget(e);
    out.push_back(std::move(e.work));
  }
  entries_.clear();
  return out;
}

}  // namespace kvtd::daemon
