/* LD_PRELOAD shim for tests: a store whose writes stall, controlled from outside the daemon.
 * While the file named by $KVTD_SLOW_RENAME_GATE exists, every rename(2) through libc waits for it
 * to go away; the file store's put writes a temporary and renames it into place, so its writes
 * stall there while its reads (open, read) do not. Only the test's daemons load it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

typedef int (*rename_fn)(const char*, const char*);

int rename(const char* from, const char* to) {
  static rename_fn real = NULL;
  if (real == NULL) real = (rename_fn)dlsym(RTLD_NEXT, "rename");
  const char* gate = getenv("KVTD_SLOW_RENAME_GATE");
  if (gate != NULL && *gate != '\0')
    while (access(gate, F_OK) == 0) usleep(1000);
  return real(from, to);
}
