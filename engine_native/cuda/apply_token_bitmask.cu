// CUDA kernel that applies an int32 token bitmask to logits in place.
//
// Not part of the CMake build: agent_infer/grammar/kernels/cuda.py compiles it at first use on a
// CUDA machine with torch.utils.cpp_extension.load (cached under AGENT_INFER_CACHE_DIR) and calls
// it as torch.ops.agent_infer_kernels.apply_token_bitmask.
//
// Contract (shared with every backend, see engine_native/src/kernels/bitmask.cpp): bit j of word w in
// row r allows token 32*w + j; a cleared bit sets that logit to -inf; tokens past the bitmask's
// width are masked too; bits past the logits' width are ignored. With indices, slot i masks row
// indices[i] of both the logits and the bitmask.
//
// Layout: one thread per token and one block per (row, 256 tokens = 8 words). The 32 threads of a
// warp read the same word, which the hardware serves as one broadcast load, and their stores to
// consecutive logits coalesce. Only masked logits are written; allowed ones are never read.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace {

constexpr int kThreadsPerBlock = 256;
// gridDim.y is limited to 65535 blocks of tokens: 16.7M tokens per row, far above any vocabulary.
constexpr int64_t kMaxTokenBlocks = 65535;

template <typename scalar_t>
__global__ void apply_token_bitmask_kernel(scalar_t* __restrict__ logits, const int32_t* __restrict__ bitmask,
                                           const int64_t* __restrict__ indices, int64_t num_rows, int64_t vocab,
                                           int64_t num_words, int64_t logits_stride, int64_t mask_stride) {
  const int64_t slot = blockIdx.x;
  const int64_t row = indices != nullptr ? indices[slot] : slot;
  // Device-resident indices cannot be range-checked on the host without a sync; a bad one is skipped.
  if (row < 0 || row >= num_rows) return;
  const int64_t token = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (token >= vocab) return;
  const int64_t word = token >> 5;
  bool allowed = false;
  if (word < num_words) {
    const uint32_t bits = static_cast<uint32_t>(__ldg(bitmask + row * mask_stride + word));
    allowed = ((bits >> (token & 31)) & 1u) != 0u;
  }
  if (!allowed) logits[row * logits_stride + token] = static_cast<scalar_t>(-INFINITY);
}

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::optional<at::Tensor>& indices) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a 2-D CUDA tensor with unit stride in the vocabulary dimension, got shape ",
              logits.sizes(), " on ", logits.device());
  TORCH_CHECK(bitmask.is_cuda() && bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.stride(1) == 1,
              "bitmask must be a 2-D int32 CUDA tensor with unit stride in the word dimension, got ",
              bitmask.scalar_type(), " shape ", bitmask.sizes(), " on ", bitmask.device());
  TORCH_CHECK(bitmask.device() == logits.device(), "bitmask is on ", bitmask.device(), " but logits are on ",
              logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  int64_t slots = logits.size(0);
  const int64_t* index_ptr = nullptr;
  if (indices.has_value()) {
    const at::Tensor& idx = *indices;
    TORCH_CHECK(idx.device() == logits.device() && idx.scalar_type() == at::kLong && idx.dim() == 1 &&
                    idx.is_contiguous(),
                "indices must be a contiguous 1-D int64 tensor on ", logits.device(), ", got ", idx.scalar_type(),
                " shape ", idx.sizes(), " on ", idx.device());
    slots = idx.numel();
    index_ptr = idx.data_ptr<int64_t>();
  }
  const int64_t vocab = logits.size(1);
  if (slots == 0 || vocab == 0) return;
  const int64_t token_blocks = (vocab + kThreadsPerBlock - 1) / kThreadsPerBlock;
  TORCH_CHECK(token_blocks <= kMaxTokenBlocks, "vocabulary of ", vocab, " tokens is too large for this kernel");
  TORCH_CHECK(slots <= INT32_MAX, "too many rows: ", slots);
  const dim3 grid(static_cast<unsigned int>(slots), static_cast<unsigned int>(token_blocks));
  const int64_t num_rows = std::min<int64_t>(logits.size(0), bitmask.size(0));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "apply_token_bitmask", [&] {
    apply_token_bitmask_kernel<scalar_t><<<grid, kThreadsPerBlock, 0, stream>>>(
        logits.data_ptr<scalar_t>(), bitmask.data_ptr<int32_t>(), index_ptr, num_rows, vocab, bitmask.size(1),
        logits.stride(0), bitmask.stride(0));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(agent_infer_kernels, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? indices) -> ()");
}

TORCH_LIBRARY_IMPL(agent_infer_kernels, CUDA, m) { m.impl("apply_token_bitmask", &apply_token_bitmask); }
