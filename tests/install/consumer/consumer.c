/* A C engine against the installed libkvtd_client.so: creates a session, makes host-backend
 * tensors, publishes, and sees that no rank is attached yet. Exit 0 when every call behaved. */
#include <kvtd/kvtd_client.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(void) {
  char err[256];
  char suffix[64];
  kvtd_geometry g;
  kvtd_session* s = NULL;
  memset(&g, 0, sizeof g);
  g.num_ranks = 1;
  g.num_layers = 2;
  g.dtype = KVTD_DTYPE_BFLOAT16;
  g.num_host_blocks = 4;
  g.key_shape[0] = 8;
  g.key_shape[1] = 1;
  g.key_shape[2] = 4;
  g.key_shape[3] = 8;
  if (kvtd_client_abi() != KVTD_CLIENT_ABI) return 1;
  snprintf(suffix, sizeof suffix, "consumer_c_%d", (int)getpid());
  if (kvtd_session_create(suffix, &g, &s, err, sizeof err) != KVTD_OK) {
    fprintf(stderr, "create: %s\n", err);
    return 2;
  }
  if (kvtd_create_host_device_tensors(s, err, sizeof err) != KVTD_OK || kvtd_publish(s, err, sizeof err) != KVTD_OK) {
    fprintf(stderr, "setup: %s\n", err);
    return 3;
  }
  int rc = kvtd_wait_ready(s, 10, err, sizeof err);
  kvtd_session_destroy(s);
  if (rc != KVTD_E_TIMEOUT) return 4;
  if (kvtd_session_create("bad/name", &g, &s, err, sizeof err) != KVTD_E_INVALID) return 5;
  printf("C consumer OK: ABI %d, no rank attached (%s), bad suffix refused\n", kvtd_client_abi(), kvtd_error_name(rc));
  return 0;
}
