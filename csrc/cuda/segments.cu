// CUDA segment ops (see csrc/cpu/segments.cpp): a block per segment for the sums, each thread
// accumulating a strided share of the segment's rows in float64 and the block merging the
// shares in a fixed tree, so a sum is the same from run to run and no value crosses segments;
// a thread per row for the gather, which finds its segment by binary search in cu_seqlens.
// One launch each, no host reads: capturable in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "../segment_common.h"

namespace gspo::cuda {
namespace {

constexpr int kSumThreads = 256;
constexpr int kExpandThreads = 256;

__device__ __forceinline__ int64_t clamp_row(int64_t r, int64_t lo, int64_t hi) {
  return r < lo ? lo : (r > hi ? hi : r);
}

template <typename scalar_t>
__global__ void segment_sum_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ cu,
                                   scalar_t* __restrict__ out, int64_t rows, int64_t k) {
  __shared__ double partial[kSumThreads];
  const int64_t s = blockIdx.x;
  const int64_t first = clamp_row(cu[s], 0, rows);
  const int64_t last = clamp_row(cu[s + 1], first, rows);
  for (int64_t c = 0; c < k; ++c) {
    double acc = 0.0;
    for (int64_t r = first + threadIdx.x; r < last; r += kSumThreads) acc += static_cast<double>(x[r * k + c]);
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int width = kSumThreads / 2; width > 0; width /= 2) {
      if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
      __syncthreads();
    }
    if (threadIdx.x == 0) out[s * k + c] = static_cast<scalar_t>(partial[0]);
    __syncthreads();  // partial[0] is read before the next column overwrites it
  }
}

template <typename scalar_t>
__global__ void segment_expand_kernel(const scalar_t* __restrict__ v, const int64_t* __restrict__ cu,
                                      scalar_t* __restrict__ out, int64_t segments, int64_t rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  if (r >= rows) return;
  // The last s with cu[s] <= r: the count of boundaries cu[1..S] that are <= r, clamped to S - 1
  // (rows outside every segment exist only with an invalid cu_seqlens).
  int64_t lo = 0, hi = segments;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid + 1] <= r) lo = mid + 1; else hi = mid;
  }
  out[r] = v[lo < segments ? lo : segments - 1];
}

at::Tensor segment_sum(const at::Tensor& x_in, const at::Tensor& cu) {
  const int64_t k = check_segment_sum_input(x_in, cu);
  TORCH_CHECK(x_in.is_cuda(), "gspo_kernels: segment_sum's CUDA kernel got ", x_in.device());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = segment_sum_output(x, cu);
  const int64_t segments = cu.numel() - 1;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gspo_kernels::segment_sum", [&] {
    segment_sum_kernel<scalar_t><<<segments, kSumThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), cu.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>(), x.size(0), k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor segment_expand(const at::Tensor& v_in, const at::Tensor& cu, int64_t rows) {
  check_segment_expand_input(v_in, cu, rows);
  TORCH_CHECK(v_in.is_cuda(), "gspo_kernels: segment_expand's CUDA kernel got ", v_in.device());
  const c10::cuda::CUDAGuard guard(v_in.device());
  const at::Tensor v = v_in.contiguous();
  at::Tensor out = at::empty({rows}, v.options());
  if (rows == 0) return out;
  const int64_t segments = cu.numel() - 1;
  const int64_t blocks = (rows + kExpandThreads - 1) / kExpandThreads;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, v.scalar_type(), "gspo_kernels::segment_expand", [&] {
    segment_expand_kernel<scalar_t><<<blocks, kExpandThreads, 0, stream>>>(
        v.const_data_ptr<scalar_t>(), cu.const_data_ptr<int64_t>(), out.data_ptr<scalar_t>(), segments, rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CUDA, m) {
  m.impl("segment_sum", &segment_sum);
  m.impl("segment_expand", &segment_expand);
}

}  // namespace gspo::cuda
