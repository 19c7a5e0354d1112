// The grammar core's exceptions; the bindings (bindings/grammar_bindings.cpp) map each to its
// agent_infer.errors class.
#pragma once

#include <stdexcept>
#include <string>

namespace agent_infer {
namespace grammar {

// Mapped to agent_infer.errors.GrammarLimitError / GrammarDefinitionError by the bindings.
struct LimitError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct DefinitionError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Mapped to agent_infer.errors.MatcherUsageError: an argument a matcher cannot take (a token id
// outside the vocabulary, a rollback past the start); `argument` names the Python argument.
struct UsageError : std::invalid_argument {
  UsageError(const std::string& message, const char* argument_)
      : std::invalid_argument(message), argument(argument_) {}
  const char* argument;
};
// Mapped to agent_infer.errors.TokenBitmaskError: a bitmask row or width that does not fit.
struct BitmaskError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Mapped to agent_infer.errors.MatcherBusyError: a matcher entered while another call on it
// (another thread's) is still running. `operation` and `running` are the two calls' names.
struct BusyError : std::runtime_error {
  BusyError(const char* operation_, const char* running_)
      : std::runtime_error(std::string("GrammarMatcher.") + operation_ + " was called while " + running_ +
                           " is running on the same matcher in another thread; a matcher serves one thread at a "
                           "time (fork() one per thread, or serialize the calls)"),
        operation(operation_),
        running(running_) {}
  const char* operation;
  const char* running;
};

}  // namespace grammar
}  // namespace agent_infer
