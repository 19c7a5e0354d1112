// Storage and Python access for the opt-in mask-time profile (grammar/mask/profile.h).
#include "grammar/mask/profile.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "bindings/bindings.h"

namespace nb = nanobind;

namespace agent_infer {
namespace grammar {
namespace profile {

std::atomic<bool> enabled{false};

Counters& counters() {
  thread_local Counters c;
  return c;
}

const char* name(int kind) {
  static const char* const names[kCount] = {
      "state_key",  "short_key", "local_key", "region_walk", "region_exits", "short_fill",   "put_short",
      "pieces",     "pieces_walk", "full_calls", "full_plain", "check_walk", "check_earley", "context_key",
      "twin", "content"};
  return names[kind];
}

}  // namespace profile
}  // namespace grammar

void register_grammar_profile(nb::module_& m) {
  namespace p = grammar::profile;
  m.def(
      "grammar_profile",
      [](std::optional<bool> enable) {
        if (enable) p::enabled.store(*enable, std::memory_order_relaxed);
        p::Counters& c = p::counters();
        nb::dict out;
        for (int k = 0; k < p::kCount; ++k) {
          if (c.calls[static_cast<size_t>(k)] == 0) continue;
          out[p::name(k)] = nb::make_tuple(c.ns[static_cast<size_t>(k)], c.calls[static_cast<size_t>(k)]);
        }
        c.ns.fill(0);
        c.calls.fill(0);
        return out;
      },
      nb::arg("enable") = nb::none(),
      "Returns {kind: (ns, calls)} of the calling thread's mask-time profile since the last call, resetting it; "
      "enable=True/False switches profiling on or off for every thread (off by default).");
}

}  // namespace agent_infer
