// The C ABI's read-only questions to a session: ranks' liveness and readiness, layer events,
// tasks in flight, where forecast waits took their results.
#include "kvtd/kvtd_client.h"

#include <cstring>

#include "c_api_handles.h"
#include "c_api_support.h"
#include "kvtd/engine/engine_session.h"

namespace {
using kvtd::c_api::closed;
using kvtd::c_api::guarded;
using kvtd::c_api::invalid;
}  // namespace

extern "C" {

int kvtd_layer_event_handle(kvtd_session* s, uint32_t rank, uint32_t layer, uint8_t out[64]) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return KVTD_E_CLOSED;
  uint32_t epoch = 0;
  return kvtd_layer_event(s, rank, layer, out, &epoch);
}

int kvtd_layer_event(kvtd_session* s, uint32_t rank, uint32_t layer, uint8_t out[64], uint32_t* epoch) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return KVTD_E_CLOSED;
  if (!s || !out || !epoch) return KVTD_E_INVALID;
  return guarded(nullptr, 0, [&]() -> int {
    auto h = use->layer_event_handle(rank, layer, epoch);
    if (!h) return KVTD_E_NO_EVENT;
    std::memcpy(out, h->data(), h->size());
    return KVTD_OK;
  });
}

int kvtd_rank_alive(kvtd_session* s, uint32_t rank) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return KVTD_E_CLOSED;
  if (!s) return 0;
  return guarded(nullptr, 0, [&]() -> int { return use->rank_alive(rank) ? 1 : 0; });
}

uint32_t kvtd_rank_ready(kvtd_session* s, uint32_t rank) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return 0;
  if (!s) return 0;
  try {
    return use->rank_ready_flags(rank);
  } catch (...) {
    return 0;
  }
}

int kvtd_session_forecast_waits(kvtd_session* s, kvtd_forecast_waits* out, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  return guarded(err, err_len, [&]() -> int {
    if (!s || !out) return invalid(err, err_len, "session and out must not be null");
    const kvtd::engine::ForecastWaits w = use->forecast_waits();
    *out = kvtd_forecast_waits{w.waits, w.before_window, w.in_window, w.after_window};
    return KVTD_OK;
  });
}

size_t kvtd_in_flight(kvtd_session* s) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return 0;
  if (!s) return 0;
  try {
    return use->in_flight();
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
