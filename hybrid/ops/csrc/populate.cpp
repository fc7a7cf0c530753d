// populate_: back a tensor's memory with pages now, without changing what it holds.
//
// A server makes its tables' initial rows lazily (hybrid/ps/server/lazy.py) and a background
// thread fills the rest. The expensive part of filling fresh memory is not computing the rows but
// the first touch of every page (on a virtual machine a fault in the host too), so the thread
// takes those faults here -- MADV_POPULATE_WRITE, outside the shard's lock and without the GIL --
// and then writes the rows into memory that is already there. POPULATE_WRITE keeps the contents
// of pages already present, so it is safe while other threads write rows of the same range.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

namespace {

using at::Tensor;

// Asks the kernel, for the whole pages inside `memory` (a contiguous CPU tensor): with
// `huge_pages`, to back them with transparent huge pages (MADV_HUGEPAGE), and with `collapse`
// to turn the small pages already there into huge ones (MADV_COLLAPSE, best effort); then to
// populate every page for writing. Returns whether the kernel populated them (false: too old a
// kernel, or memory it cannot populate; the pages then come at the first write, as usual).
bool populate_(const Tensor& memory, bool huge_pages, bool collapse) {
  TORCH_CHECK_VALUE(memory.device().is_cpu() && memory.is_contiguous(),
                    "memory must be a contiguous CPU tensor");
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(memory.data_ptr());
  const auto end = begin + static_cast<uintptr_t>(memory.numel()) * memory.element_size();
  // Whole pages only: a page at either edge may belong to memory outside the tensor.
  const uintptr_t lo = (begin + page - 1) / page * page, hi = end / page * page;
  if (hi <= lo) return true;
  void* addr = reinterpret_cast<void*>(lo);
  const size_t len = hi - lo;
  if (huge_pages) {
    (void)madvise(addr, len, MADV_HUGEPAGE);
    if (collapse) (void)madvise(addr, len, MADV_COLLAPSE);
  }
  return madvise(addr, len, MADV_POPULATE_WRITE) == 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.def("populate_(Tensor(a!) memory, bool huge_pages, bool collapse) -> bool");
}

TORCH_LIBRARY_IMPL(hybrid, CompositeExplicitAutograd, m) { m.impl("populate_", populate_); }
