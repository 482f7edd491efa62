// A C++ engine against the installed libkvtd_client.so through the same C ABI: submits to a
// session no rank serves and sees it refused, naming the rank. Exit 0 when every call behaved.
#include <kvtd/kvtd_client.h>
#include <unistd.h>

#include <cstdio>
#include <string>

int main() {
  kvtd_geometry g{};
  g.num_ranks = 2;
  g.num_layers = 1;
  g.dtype = KVTD_DTYPE_FLOAT16;
  g.num_host_blocks = 4;
  g.key_shape[0] = 8;
  g.key_shape[1] = 1;
  g.key_shape[2] = 4;
  g.key_shape[3] = 8;
  char err[256] = {0};
  kvtd_session* s = nullptr;
  const std::string suffix = "consumer_cpp_" + std::to_string(getpid());
  if (kvtd_session_create(suffix.c_str(), &g, &s, err, sizeof err) != KVTD_OK) {
    std::fprintf(stderr, "create: %s\n", err);
    return 2;
  }
  if (kvtd_create_host_device_tensors(s, err, sizeof err) != KVTD_OK || kvtd_publish(s, err, sizeof err) != KVTD_OK)
    return 3;
  const int32_t src[1] = {0}, dst[1] = {1};
  uint64_t id = 0;
  const int rc = kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 10, &id, err, sizeof err);
  kvtd_session_destroy(s);
  if (rc != KVTD_E_NOT_READY || std::string(err).find("rank 0") == std::string::npos) return 4;
  std::printf("C++ consumer OK: %s\n", err);
  return 0;
}
