// The per-thread work buffers of the lowering (LoweringScratch, see grammar/lower/scratch.h).
#include "grammar/lower/scratch.h"
#include "grammar/thread_slot.h"

namespace agent_infer {
namespace grammar {
namespace {

// Past this the buffers are released after the grammar instead of kept: one huge grammar should
// not pin tens of megabytes per thread for the small ones that follow.
constexpr size_t kMaxRetainedBytes = size_t{16} << 20;

struct ThreadScratch {
  std::unique_ptr<LoweringScratch> scratch;
  bool lent = false;
};

ThreadScratch& thread_scratch() {
  return thread_slot<ThreadScratch>();
}

template <typename V>
size_t capacity_bytes(const V& v) {
  return v.capacity() * sizeof(typename V::value_type);
}

}  // namespace

size_t LoweringScratch::retained_bytes() const {
  size_t n = capacity_bytes(nfa.eps_begin) + capacity_bytes(nfa.byte_begin) + capacity_bytes(nfa.ref_begin) +
             capacity_bytes(nfa.eps) + capacity_bytes(nfa.bytes) + capacity_bytes(nfa.refs) +
             capacity_bytes(pool.final) + capacity_bytes(pool.byte_begin) + capacity_bytes(pool.ref_begin) +
             capacity_bytes(pool.bytes) + capacity_bytes(pool.refs) + determinizer.retained_bytes() +
             nfa_shared.retained_bytes();
  for (const auto* v : {&base, &order, &work, &stack, &pending, &remap, &rep}) n += capacity_bytes(*v);
  for (const auto* v : {&count, &caller_begin, &callers, &fill, &seen, &rev_begin, &rev, &reached}) {
    n += capacity_bytes(*v);
  }
  for (const auto* v : {&built, &productive, &queued, &live, &emit, &stored}) n += capacity_bytes(*v);
  return n;
}

ScratchLease::ScratchLease() {
  ThreadScratch& slot = thread_scratch();
  if (slot.lent) {
    own_ = std::make_unique<LoweringScratch>();
    scratch_ = own_.get();
    return;
  }
  if (!slot.scratch) slot.scratch = std::make_unique<LoweringScratch>();
  slot.lent = true;
  scratch_ = slot.scratch.get();
}

ScratchLease::~ScratchLease() {
  if (own_) return;
  ThreadScratch& slot = thread_scratch();
  slot.lent = false;
  if (slot.scratch->retained_bytes() > kMaxRetainedBytes) slot.scratch.reset();
}

}  // namespace grammar
}  // namespace agent_infer
