// cache_state.h (client/engine internal) - the KV cache's state across a weight update, as the
// engine keeps it for itself (the daemons read its mirror in the header, proto::CacheState):
// live; cleared (tasks refused; CLEAR_CACHE sent); or cleared and confirmed by every rank (no
// daemon maps the tensors any more: they may be freed and registered anew).
//
// Thread-safety: none (kept under the session's mutex). Copyable.
#pragma once

namespace kvtd::engine {

class CacheState {
 public:
  bool cleared() const { return cleared_; }
  // Cleared and confirmed by every rank.
  bool confirmed() const { return cleared_ && confirmed_; }
  // Cleared (a clear begins, a restore could not go through) or live again; unconfirmed either way.
  void set(bool cleared) {
    cleared_ = cleared;
    confirmed_ = false;
  }
  // Every rank answered the clear: confirmed, unless a restore began since.
  void confirm() { confirmed_ = cleared_; }
  // A restore begins: the tensors are the daemons' again.
  void restore_begins() { confirmed_ = false; }

 private:
  bool cleared_ = false;
  bool confirmed_ = false;
};

}  // namespace kvtd::engine
