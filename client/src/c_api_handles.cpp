#include "c_api_handles.h"

#include <unordered_map>
#include <vector>

#include "kvtd/base/mutex.h"

struct kvtd_session {
  std::unique_ptr<kvtd::engine::EngineSession> session;
};

namespace kvtd::c_api {
namespace {

struct Registry {
  Mutex mu;
  CondVar unused;
  std::unordered_map<kvtd_session*, int> live GUARDED_BY(mu);  // live handle -> calls inside it
  std::unordered_map<kvtd_session*, int> retiring GUARDED_BY(mu);  // destroy waits for these calls
  // Destroyed handles' structs, kept (16 bytes each) so that no later session gets their address.
  std::vector<kvtd_session*> retired GUARDED_BY(mu);
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: calls may still arrive during exit
  return *r;
}

}  // namespace

kvtd_session* adopt_session(std::unique_ptr<engine::EngineSession> session) {
  auto* s = new kvtd_session{std::move(session)};
  auto& r = registry();
  MutexLock g(r.mu);
  r.live.emplace(s, 0);
  return s;
}

std::unique_ptr<engine::EngineSession> retire_session(kvtd_session* s, bool* was_live) {
  auto& r = registry();
  {
    MutexLock g(r.mu);
    auto it = r.live.find(s);
    *was_live = it != r.live.end();
    if (!*was_live) return nullptr;
    r.retiring.emplace(s, it->second);
    r.live.erase(it);
  }
  // Calls inside may be waiting in the session: closing wakes them (they return KVTD_E_CLOSED),
  // and calls that entered but have not reached the session yet find it closing.
  s->session->close();
  MutexLock g(r.mu);
  while (r.retiring[s] != 0) r.unused.wait(g);
  r.retiring.erase(s);
  r.retired.push_back(s);  // the struct stays: its address is never reused
  return std::move(s->session);
}

SessionUse::SessionUse(kvtd_session* s) {
  if (s == nullptr) return;
  auto& r = registry();
  MutexLock g(r.mu);
  auto it = r.live.find(s);
  if (it == r.live.end()) return;
  ++it->second;
  handle_ = s;
  session_ = s->session.get();
}

SessionUse::~SessionUse() {
  if (handle_ == nullptr) return;
  auto& r = registry();
  MutexLock g(r.mu);
  // Still live, or being destroyed (then destroy waits for this count to reach 0).
  auto it = r.live.find(handle_);
  if (it != r.live.end()) {
    --it->second;
    return;
  }
  if (--r.retiring[handle_] == 0) r.unused.notify_all();
}

}  // namespace kvtd::c_api
