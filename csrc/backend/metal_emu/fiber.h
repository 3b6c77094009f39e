// Stackful fibers for the execution model's threads: a fiber runs on a stack the caller provides
// and gives control back only by switching explicitly. x86-64 uses a hand-written switch (callee-
// saved registers and the floating-point control words, no system call); other hosts use
// ucontext.
#pragma once

#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace routemm::metal_emu {

class Fiber {
 public:
  using Entry = void (*)(void* argument);

  // Prepares the fiber to call entry(argument) on [stack, stack + size) when first resumed.
  // `entry` must never return: it ends by switching away for good.
  void prepare(void* stack, size_t size, Entry entry, void* argument);

  // Saves the current context in `from` and continues `to`.
  static void switch_to(Fiber& from, Fiber& to);

 private:
#if defined(__x86_64__)
  void* sp_ = nullptr;
#else
  ucontext_t context_{};
#endif
};

}  // namespace routemm::metal_emu
