// Per-thread instances of the grammar core's scratch state.
#pragma once



namespace agent_infer {
namespace grammar {

// This thread's instance of T. Out of line on purpose: where a thread_local is used inline, GCC
// recomputes its address (a __tls_get_addr call in a shared library) at every use rather than
// keep it in a register, dozens of calls per mask fill.
template <class T>
[[gnu::noinline]] T& thread_slot() {
  thread_local T slot;
  return slot;
}

}  // namespace grammar
}  // namespace agent_infer
