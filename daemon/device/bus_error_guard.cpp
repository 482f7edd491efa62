#include "bus_error_guard.h"

#include <csetjmp>
#include <csignal>
#include <cstring>
#include <mutex>

namespace kvtd::daemon {
namespace {

struct Guard {
  sigjmp_buf env;
  volatile std::uintptr_t fault = 0;
};
thread_local Guard* tls_guard = nullptr;
struct sigaction previous_action;

void on_bus_error(int sig, siginfo_t* info, void* context) {
  Guard* g = tls_guard;
  if (g != nullptr) {
    g->fault = reinterpret_cast<std::uintptr_t>(info->si_addr);
    siglongjmp(g->env, 1);
  }
  // Not in a guarded copy: a bug of ours, which must still crash as it always did.
  if (previous_action.sa_flags & SA_SIGINFO) {
    if (previous_action.sa_sigaction != nullptr) return previous_action.sa_sigaction(sig, info, context);
  } else if (previous_action.sa_handler != SIG_DFL && previous_action.sa_handler != SIG_IGN) {
    return previous_action.sa_handler(sig);
  }
  signal(SIGBUS, SIG_DFL);  // the faulting access runs again and ends the process
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus_error;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &previous_action);
  });
}

}  // namespace

std::optional<std::uintptr_t> survive_bus_error(void (*copy)(void*), void* arg) {
  install_once();
  Guard guard;
  Guard* const outer = tls_guard;
  // The mask is saved and restored (savemask 1, a sigprocmask call per copy) although the handler
  // asks for SA_NODEFER: a runtime that wraps handlers may still block SIGBUS inside (ThreadSanitizer
  // does), and a second bus error while it stays blocked kills the process. Without it, TSan's
  // run of CacheClearTest.MemoryTheEngineShrankFailsTheTaskAndTheDaemonServesOn lost the daemon
  // at its second fault.
  if (sigsetjmp(guard.env, 1) != 0) {
    tls_guard = outer;
    return guard.fault;
  }
  tls_guard = &guard;
  copy(arg);
  tls_guard = outer;
  return std::nullopt;
}

}  // namespace kvtd::daemon
