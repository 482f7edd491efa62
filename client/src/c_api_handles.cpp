#include "c_api_handles.h"

#include <unordered_set>

#include "kvtd/base/mutex.h"

struct kvtd_session {
  std::unique_ptr<kvtd::engine::EngineSession> session;
  int users = 0;  // calls inside, counted under the registry's mutex
};

namespace kvtd::c_api {
namespace {

struct Registry {
  Mutex mu;
  CondVar unused;
  std::unordered_set<kvtd_session*> live GUARDED_BY(mu);
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: calls may still arrive during exit
  return *r;
}

}  // namespace

kvtd_session* adopt_session(std::unique_ptr<engine::EngineSession> session) {
  auto* s = new kvtd_session{std::move(session), 0};
  auto& r = registry();
  MutexLock g(r.mu);
  r.live.insert(s);
  return s;
}

std::unique_ptr<engine::EngineSession> retire_session(kvtd_session* s, bool* was_live) {
  auto& r = registry();
  {
    MutexLock g(r.mu);
    *was_live = r.live.erase(s) != 0;
    if (!*was_live) return nullptr;
  }
  // Calls inside may be waiting in the session: closing wakes them (they return KVTD_E_CLOSED),
  // and calls that entered but have not reached the session yet find it closing.
  s->session->close();
  MutexLock g(r.mu);
  while (s->users != 0) r.unused.wait(g);
  return std::move(s->session);  // the struct stays: its address is never reused
}

SessionUse::SessionUse(kvtd_session* s) {
  if (s == nullptr) return;
  auto& r = registry();
  MutexLock g(r.mu);
  if (r.live.count(s) == 0) return;
  ++s->users;
  handle_ = s;
  session_ = s->session.get();
}

SessionUse::~SessionUse() {
  if (handle_ == nullptr) return;
  auto& r = registry();
  MutexLock g(r.mu);
  if (--handle_->users == 0) r.unused.notify_all();
}

}  // namespace kvtd::c_api
