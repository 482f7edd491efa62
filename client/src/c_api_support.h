// c_api_support.h (client internal) - what every C ABI entry point uses: errors into the
// caller's buffer, and no C++ exception crossing extern "C".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "kvtd/kvtd_client.h"

namespace kvtd::c_api {

// Copies `msg` into `err` (truncated, NUL-terminated); nothing when err is null or len 0.
inline void put_error(char* err, size_t len, const std::string& msg) {
  if (!err || len == 0) return;
  const size_t n = msg.size() < len - 1 ? msg.size() : len - 1;
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

// Milliseconds to nanoseconds without overflow (a huge timeout saturates, it does not wrap).
inline std::int64_t ms_to_ns(std::int64_t ms) {
  if (ms <= 0) return 0;
  return ms > INT64_MAX / 1'000'000 ? INT64_MAX : ms * 1'000'000;
}

inline int invalid(char* err, size_t len, const std::string& msg) {
  put_error(err, len, msg);
  return KVTD_E_INVALID;
}

// A call on a handle kvtd_session_destroy has retired.
inline int closed(char* err, size_t len) {
  put_error(err, len, "the session handle was destroyed: no call may use it after kvtd_session_destroy");
  return KVTD_E_CLOSED;
}

// No exception may cross extern "C": every entry point runs its body through this.
template <typename F>
inline int guarded(char* err, size_t len, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    put_error(err, len, "out of memory");
    return KVTD_E_SYSTEM;
  } catch (const std::exception& e) {
    put_error(err, len, std::string("internal error: ") + e.what());
    return KVTD_E_SYSTEM;
  } catch (...) {
    put_error(err, len, "internal error");
    return KVTD_E_SYSTEM;
  }
}

}  // namespace kvtd::c_api
