// The C ABI's geometry rules and version (kvtd/kvtd_client.h): asked of the library by the
// Python module instead of re-derived there.
#include <cstring>
#include <string>

#include "c_api_support.h"
#include "kvtd/base/version.h"
#include "kvtd/kvtd_client.h"
#include "kvtd/proto/session.h"

namespace proto = kvtd::proto;

using kvtd::c_api::guarded;
using kvtd::c_api::invalid;

extern "C" {

const char* kvtd_version(void) { return kvtd::kVersion; }

int kvtd_geometry_check(const kvtd_geometry* g, char* err, size_t err_len) {
  if (!g) return invalid(err, err_len, "null geometry");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGeometry pg{};
    std::memcpy(&pg, g, sizeof pg);  // same layout (static_asserts above)
    if (auto why = proto::geometry_problem(pg); !why.empty()) return invalid(err, err_len, why);
    return KVTD_OK;
  });
}

int kvtd_tensor_shape(const kvtd_geometry* g, uint32_t layer, uint32_t kind, int64_t shape[4], uint32_t* ndim,
                      uint64_t* block_bytes, uint64_t* bytes, char* err, size_t err_len) {
  if (!g) return invalid(err, err_len, "null geometry");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGeometry pg{};
    std::memcpy(&pg, g, sizeof pg);
    if (auto why = proto::geometry_problem(pg); !why.empty()) return invalid(err, err_len, why);
    if (layer >= pg.num_layers)
      return invalid(err, err_len, "layer " + std::to_string(layer) + " is outside [0, " + std::to_string(pg.num_layers) + ")");
    if (kind >= proto::kTensorKinds) return invalid(err, err_len, "tensor kind " + std::to_string(kind) + " is not 0..3");
    const auto k = static_cast<proto::TensorKind>(kind);
    const bool present = pg.has_tensor(k);
    const proto::TensorDesc d = present ? proto::describe_tensor(pg, 0, layer, k) : proto::TensorDesc{};
    if (shape)
      for (int i = 0; i < 4; ++i) shape[i] = i < static_cast<int>(d.ndim) ? d.shape[i] : 0;
    if (ndim) *ndim = d.ndim;
    if (block_bytes) *block_bytes = present ? pg.block_bytes(k) : 0;
    if (bytes) *bytes = d.bytes;
    return KVTD_OK;
  });
}

}  // extern "C"
