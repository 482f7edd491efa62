// c_api_task.h (client internal) - a kvtd_task checked field by field and turned into the
// engine's TaskRequest (c_api_task.cpp, which also holds the checks that the C header's constants
// and structs mirror the internal ones).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "kvtd/engine/engine_session.h"
#include "kvtd/kvtd_client.h"

namespace kvtd::c_api {

// KVTD_OK and `*r` filled (its keys pointing into `*keys`, which the caller keeps alive until the
// submit), or KVTD_E_INVALID with `err` naming the field that is wrong. `groups`: the session's
// cache groups (0: a single shape), whose storage tasks name num_keys x groups blocks, -1 for
// none. Thread-safe (no state).
int to_request(const kvtd_task& t, std::vector<std::string>* keys, kvtd::engine::TaskRequest* r, char* err,
               size_t len, std::uint32_t groups = 0);

}  // namespace kvtd::c_api
