// die_with_parent: have the kernel signal this process when the thread that started it ends.
//
// torchrun starts the workers in sessions of their own and stops them itself; an agent killed
// outright (kill -9, the OOM killer) cannot, and its workers would run on, orphaned. Linux's
// parent-death signal (prctl PR_SET_PDEATHSIG) ends them with it.
#include <torch/library.h>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <cstdint>

namespace {

// Asks for `signal` at the parent's end; returns whether the kernel took the request (false:
// not Linux, or refused).
bool die_with_parent(int64_t signal) {
  TORCH_CHECK_VALUE(signal >= 1 && signal <= 64, "signal must be a signal number in 1..64, got ", signal);
#if defined(__linux__)
  return prctl(PR_SET_PDEATHSIG, static_cast<unsigned long>(signal), 0, 0, 0) == 0;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) { m.def("die_with_parent(int signal) -> bool", die_with_parent); }
