#include "backend/metal_emu/fiber.h"

#include <cstdint>

namespace routemm::metal_emu {

#if defined(__x86_64__)

// routemm_emu_switch(save, load): pushes the callee-saved registers and MXCSR / x87 control word
// on the current stack, stores the stack pointer in *save, loads `load` and pops the same frame.
// A new fiber's frame returns into routemm_emu_fiber_start, which calls r13(r12).
extern "C" void routemm_emu_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .globl routemm_emu_switch
  .hidden routemm_emu_switch
  .type routemm_emu_switch, @function
routemm_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size routemm_emu_switch, .-routemm_emu_switch

  .p2align 4
  .globl routemm_emu_fiber_start
  .hidden routemm_emu_fiber_start
  .type routemm_emu_fiber_start, @function
routemm_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size routemm_emu_fiber_start, .-routemm_emu_fiber_start
)");
extern "C" void routemm_emu_fiber_start();

void Fiber::prepare(void* stack, size_t size, Entry entry, void* argument) {
  // Frame, from the saved stack pointer up: control words, r15 r14 r13 r12 rbx rbp, return
  // address. After `ret` the stack pointer is 16-byte aligned, as a call site needs.
  auto top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top - 16 - 8 * 8);
  uint32_t control[2];
  asm volatile("stmxcsr %0" : "=m"(control[0]));
  asm volatile("fnstcw %0" : "=m"(control[1]));
  frame[0] = uint64_t{control[0]} | (uint64_t{control[1]} << 32);
  frame[1] = 0;                                     // r15
  frame[2] = 0;                                     // r14
  frame[3] = reinterpret_cast<uint64_t>(entry);     // r13
  frame[4] = reinterpret_cast<uint64_t>(argument);  // r12
  frame[5] = 0;                                     // rbx
  frame[6] = 0;                                     // rbp
  frame[7] = reinterpret_cast<uint64_t>(&routemm_emu_fiber_start);
  sp_ = frame;
}

void Fiber::switch_to(Fiber& from, Fiber& to) { routemm_emu_switch(&from.sp_, to.sp_); }

#else

namespace {
void start(unsigned high, unsigned low, unsigned entry_high, unsigned entry_low) {
  auto* argument = reinterpret_cast<void*>((uintptr_t{high} << 32) | low);
  auto entry = reinterpret_cast<Fiber::Entry>((uintptr_t{entry_high} << 32) | entry_low);
  entry(argument);
}
}  // namespace

void Fiber::prepare(void* stack, size_t size, Entry entry, void* argument) {
  getcontext(&context_);
  context_.uc_stack.ss_sp = stack;
  context_.uc_stack.ss_size = size;
  context_.uc_link = nullptr;
  const auto a = reinterpret_cast<uintptr_t>(argument);
  const auto e = reinterpret_cast<uintptr_t>(entry);
  makecontext(&context_, reinterpret_cast<void (*)()>(&start), 4, unsigned(a >> 32), unsigned(a),
              unsigned(e >> 32), unsigned(e));
}

void Fiber::switch_to(Fiber& from, Fiber& to) { swapcontext(&from.context_, &to.context_); }

#endif

}  // namespace routemm::metal_emu
