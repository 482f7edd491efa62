// c_api_handles.h (client internal) - the C ABI's live session handles. A call on a handle that
// was destroyed, or is being destroyed, is refused with KVTD_E_CLOSED instead of touching freed
// memory, and two threads destroying one handle free it once (issue 30 item 7: documented misuse
// may be refused, it must not corrupt).
//
// A destroyed handle's small struct (a pointer and a count) is kept, never freed, so its address
// cannot be handed to a later session and a stale call can never reach another session.
//
// Thread-safety: every function from any thread; one process-wide mutex, held only to look a
// handle up or count its users, never across a call into the session.
#pragma once

#include <memory>

#include "kvtd/engine/engine_session.h"
#include "kvtd/kvtd_client.h"

namespace kvtd::c_api {

// Makes a live handle owning `session`.
kvtd_session* adopt_session(std::unique_ptr<engine::EngineSession> session);

// Takes `s` out of use: false when it is not live (destroyed, or another destroy is under way).
// Then waits until no call that entered before is inside, and returns the session to close.
std::unique_ptr<engine::EngineSession> retire_session(kvtd_session* s, bool* was_live);

// One call's use of a handle: live (use it through ->), null, or gone (destroyed).
// Not copyable; the destructor ends the use.
class SessionUse {
 public:
  explicit SessionUse(kvtd_session* s);
  ~SessionUse();
  SessionUse(const SessionUse&) = delete;
  SessionUse& operator=(const SessionUse&) = delete;

  bool live() const { return session_ != nullptr; }
  engine::EngineSession* operator->() const { return session_; }
  engine::EngineSession& operator*() const { return *session_; }

 private:
  kvtd_session* handle_ = nullptr;
  engine::EngineSession* session_ = nullptr;
};

}  // namespace kvtd::c_api
