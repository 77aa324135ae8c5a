// CUDA kernels for stage 1 (token stats) and stage 3 (logits gradient).
//
// A row per 256-thread block for large vocabularies, a row per warp for small ones (V <=
// 2048), so no lane idles on a short row. Each thread streams 16-byte packs of logits
// (coalesced across the row's threads), kUnroll packs in flight at once; fp32 math; row
// offsets in int64. Stage 1 takes each batch of kUnroll packs' max, then one exp per logit,
// and merges the batch's stats into its own (gspo_math.h); threads then merge through warp
// shuffles and shared memory. Rows whose start is not 16-byte aligned take the scalar path.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

#include "../gspo_math.h"
#include "../op_common.h"

namespace gspo::cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kWarpPerRowMaxVocab = 2048;

struct DeviceOps {
  static __host__ __device__ __forceinline__ float exp(float x) {
#ifdef __CUDA_ARCH__
    // ex2.approx: 2 + |1.17 x| ulp, flushing results below 2^-126 to 0; the kernels pass only
    // x <= 0 (z - max, z - lse), so the larger errors land on terms weighted by e^x itself.
    return __expf(x);
#else
    return expf(x);
#endif
  }
  static __host__ __device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
  static __host__ __device__ __forceinline__ float fma(float a, float b, float c) { return fmaf(a, b, c); }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename scalar_t>
struct TokenStatsArgs {
  const scalar_t* logits;
  const int64_t* targets;
  float* logp;
  float* entropy;
  float* lse;
  RowLayout layout;
  LogitMap map;
  const float* kept_min;  // null: every token kept (no sampler's kept set)
};

template <typename scalar_t>
struct GradArgs {
  const scalar_t* logits;  // may equal grad (in place): each thread reads its packs before writing them
  scalar_t* grad;
  RowLayout in;
  RowLayout out;
  const int64_t* targets;
  const float* lse;
  const float* entropy;
  const float* grad_logp;
  const float* grad_entropy;
  const bool* row_mask;  // null: every row is in the loss
  LogitMap map;
  const float* kept_min;  // null: every token kept
};

// z of a logit, -inf below the row's kept-set minimum (the sampler's kept set).
__device__ __forceinline__ float mapped(float x, const LogitMap& map, float kept) {
  return x < kept ? -INFINITY : map(x);
}

template <int kThreadsPerRow>
struct RowThreads {
  static constexpr int kRowsPerBlock = kBlockThreads / kThreadsPerRow;
  __device__ static int64_t row() { return int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow; }
  __device__ static int lane() { return threadIdx.x % kThreadsPerRow; }
};

// This thread's share of one row: packs lane, lane + kThreadsPerRow, ..., then the tail.
template <typename scalar_t, int kVec, int kThreadsPerRow>
__device__ SoftmaxStats thread_row_stats(const scalar_t* row, int64_t vocab, const LogitMap& map, float kept,
                                         int lane) {
  using P = Pack<scalar_t, kVec>;
  const P* packs = reinterpret_cast<const P*>(row);
  const int64_t n_packs = vocab / kVec;
  SoftmaxStats st = empty_stats();
  for (int64_t base = lane; base < n_packs; base += int64_t(kThreadsPerRow) * kUnroll) {
    float z[kUnroll * kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kThreadsPerRow;
      if (i < n_packs) {
        const P p = packs[i];
#pragma unroll
        for (int k = 0; k < kVec; ++k) z[u * kVec + k] = mapped(static_cast<float>(p.v[k]), map, kept);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) z[u * kVec + k] = -INFINITY;
      }
    }
    SoftmaxStats batch{-INFINITY, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kUnroll * kVec; ++j) batch.max = fmaxf(batch.max, z[j]);
    const float shift = finite_or_zero(batch.max);
#pragma unroll
    for (int j = 0; j < kUnroll * kVec; ++j) accumulate_shifted<DeviceOps>(z[j] - shift, batch.sum, batch.shifted);
    st = merge_stats(st, batch);
  }
  for (int64_t v = n_packs * kVec + lane; v < vocab; v += kThreadsPerRow) {
    const float z = mapped(static_cast<float>(row[v]), map, kept);
    SoftmaxStats one{z, 0.f, 0.f};
    accumulate_shifted<DeviceOps>(z - finite_or_zero(z), one.sum, one.shifted);
    st = merge_stats(st, one);
  }
  return st;
}

__device__ __forceinline__ SoftmaxStats shfl_xor_stats(const SoftmaxStats& s, int mask) {
  return {__shfl_xor_sync(0xffffffffu, s.max, mask), __shfl_xor_sync(0xffffffffu, s.sum, mask),
          __shfl_xor_sync(0xffffffffu, s.shifted, mask)};
}

// Merges the stats of a row's threads; every thread of the block must call it.
template <int kThreadsPerRow>
__device__ SoftmaxStats reduce_row(SoftmaxStats st) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) st = merge_stats(st, shfl_xor_stats(st, mask));
  if constexpr (kThreadsPerRow > 32) {
    static_assert(kThreadsPerRow == kBlockThreads, "a multi-warp row spans the whole block");
    __shared__ SoftmaxStats warp_stats[kBlockThreads / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_stats[warp] = st;
    __syncthreads();
    st = lane < kBlockThreads / 32 ? warp_stats[lane] : empty_stats();
#pragma unroll
    for (int mask = kBlockThreads / 64; mask > 0; mask >>= 1) st = merge_stats(st, shfl_xor_stats(st, mask));
  }
  return st;
}

template <typename scalar_t, int kVec, int kThreadsPerRow>
__global__ void __launch_bounds__(kBlockThreads) token_stats_kernel(TokenStatsArgs<scalar_t> a) {
  using Threads = RowThreads<kThreadsPerRow>;
  const int64_t row = Threads::row();
  const int lane = Threads::lane();
  const bool in_range = row < a.layout.rows;
  const scalar_t* row_ptr = a.logits + (in_range ? a.layout.offset(row) : 0);
  SoftmaxStats st = empty_stats();
  const float kept = (in_range && a.kept_min != nullptr) ? a.kept_min[row] : -INFINITY;
  if (in_range) st = thread_row_stats<scalar_t, kVec, kThreadsPerRow>(row_ptr, a.layout.vocab, a.map, kept, lane);
  st = reduce_row<kThreadsPerRow>(st);
  if (in_range && lane == 0) {
    const RowResult r = finish_stats(st);
    const int64_t y = a.targets[row];
    const bool valid = y >= 0 && y < a.layout.vocab;  // never read outside the row
    a.logp[row] = valid ? r.logprob(mapped(static_cast<float>(row_ptr[y]), a.map, kept)) : NAN;  // -inf outside
    a.entropy[row] = r.entropy;
    a.lse[row] = r.lse;
  }
}

template <typename scalar_t, int kVec, int kThreadsPerRow, bool kEntropyGrad>
__global__ void __launch_bounds__(kBlockThreads) logits_grad_kernel(GradArgs<scalar_t> a) {
  using Threads = RowThreads<kThreadsPerRow>;
  using P = Pack<scalar_t, kVec>;
  const int64_t row = Threads::row();
  const int lane = Threads::lane();
  if (row >= a.in.rows) return;  // no block-wide sync below
  const int64_t vocab = a.in.vocab;
  const int64_t n_packs = vocab / kVec;
  const scalar_t* src_elems = a.logits + a.in.offset(row);
  scalar_t* dst_elems = a.grad + a.out.offset(row);
  const P* src = reinterpret_cast<const P*>(src_elems);
  P* dst = reinterpret_cast<P*>(dst_elems);
  const float g = a.grad_logp[row];
  const float h = kEntropyGrad ? a.grad_entropy[row] : 0.f;
  const int64_t y = a.targets[row];
  const RowAction action = row_action(a.row_mask == nullptr || a.row_mask[row], a.lse[row], y, vocab, g, h);
  if (action != RowAction::kCompute) {  // zeros or NaN throughout, and the row is never read
    const scalar_t fill = scalar_t(action == RowAction::kZero ? 0.f : NAN);
    P packed;
#pragma unroll
    for (int k = 0; k < kVec; ++k) packed.v[k] = fill;
    for (int64_t i = lane; i < n_packs; i += kThreadsPerRow) dst[i] = packed;
    for (int64_t v = n_packs * kVec + lane; v < vocab; v += kThreadsPerRow) dst_elems[v] = fill;
    return;
  }
  const LogitMap map = a.map;
  const float inv_t = map.scale;
  const float neg_lse = -a.lse[row];
  const float entropy = kEntropyGrad ? a.entropy[row] : 0.f;
  const float neg_g = -g * inv_t, neg_h = -h * inv_t, g_scaled = g * inv_t;
  const float kept = a.kept_min != nullptr ? a.kept_min[row] : -INFINITY;
  // Uniform across the row's threads: no divergence. A row that keeps every token (kept = -inf)
  // takes the plain path, bitwise the plain result.
  const bool general = map.capped() || kept != -INFINITY;
  auto grad_of = [&](float x, int64_t v) {
    if (general) {
      const float z = map(x);
      float d = softmax_grad_term<DeviceOps, kEntropyGrad>((x < kept ? -INFINITY : z) + neg_lse, entropy, -g, -h);
      if (v == y && !(x < kept)) d += g;  // a target outside the kept set has no one-hot term
      return scalar_t(d * map.slope(z));
    }
    float d = softmax_grad_term<DeviceOps, kEntropyGrad>(fmaf(x, inv_t, neg_lse), entropy, neg_g, neg_h);
    if (v == y) d += g_scaled;
    return scalar_t(d);
  };
  for (int64_t base = lane; base < n_packs; base += int64_t(kThreadsPerRow) * kUnroll) {
    P in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kThreadsPerRow;
      if (i < n_packs) in[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kThreadsPerRow;
      if (i < n_packs) {
        P out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) out.v[k] = grad_of(static_cast<float>(in[u].v[k]), i * kVec + k);
        dst[i] = out;
      }
    }
  }
  for (int64_t v = n_packs * kVec + lane; v < vocab; v += kThreadsPerRow) {
    dst_elems[v] = grad_of(static_cast<float>(src_elems[v]), v);
  }
}

template <typename scalar_t>
constexpr int pack_size() {
  return 16 / sizeof(scalar_t);
}

// Every row starts on a 16-byte boundary (strides of single-row dims do not matter). A vocab
// that is not a multiple of the pack size (50257) therefore takes the scalar path.
template <typename scalar_t>
bool rows_16b_aligned(const void* base, const RowLayout& l) {
  const int64_t bytes = sizeof(scalar_t);
  const bool several_batches = l.rows > l.rows_per_batch;
  const bool several_rows_per_batch = l.rows_per_batch > 1;
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (!several_batches || (l.stride_b * bytes) % 16 == 0) &&
         (!several_rows_per_batch || (l.stride_t * bytes) % 16 == 0);
}

// Calls launch.template run<kVec, kThreadsPerRow>() for this problem's shape and alignment.
template <typename scalar_t, typename Launch>
void with_kernel_shape(bool aligned, int64_t vocab, const Launch& launch) {
  constexpr int kVec = pack_size<scalar_t>();
  const bool warp_per_row = vocab <= kWarpPerRowMaxVocab;
  if (aligned && warp_per_row) launch.template run<kVec, 32>();
  else if (aligned) launch.template run<kVec, kBlockThreads>();
  else if (warp_per_row) launch.template run<1, 32>();
  else launch.template run<1, kBlockThreads>();
}

unsigned int grid_for(int64_t rows, int threads_per_row) {
  const int64_t rows_per_block = kBlockThreads / threads_per_row;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  TORCH_CHECK(blocks <= INT_MAX, "gspo_kernels: too many rows for one launch: ", rows);
  return static_cast<unsigned int>(blocks);
}

template <typename scalar_t>
struct TokenStatsLaunch {
  const TokenStatsArgs<scalar_t>& args;
  cudaStream_t stream;

  template <int kVec, int kThreadsPerRow>
  void run() const {
    token_stats_kernel<scalar_t, kVec, kThreadsPerRow>
        <<<grid_for(args.layout.rows, kThreadsPerRow), kBlockThreads, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

template <typename scalar_t>
struct GradLaunch {
  const GradArgs<scalar_t>& args;
  cudaStream_t stream;

  template <int kVec, int kThreadsPerRow>
  void run() const {
    const unsigned int grid = grid_for(args.in.rows, kThreadsPerRow);
    if (args.grad_entropy != nullptr) {
      logits_grad_kernel<scalar_t, kVec, kThreadsPerRow, true><<<grid, kBlockThreads, 0, stream>>>(args);
    } else {
      logits_grad_kernel<scalar_t, kVec, kThreadsPerRow, false><<<grid, kBlockThreads, 0, stream>>>(args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_stats(const at::Tensor& logits, const at::Tensor& targets,
                                                           double inv_temperature, double softcap,
                                                           const std::optional<at::Tensor>& kept_min) {
  check_logits(logits, c10::kCUDA);
  const LogitMap map = logit_map(inv_temperature, softcap);
  const RowLayout layout = row_layout(logits);
  check_row_vector("targets", targets, logits, layout.rows, at::kLong);
  if (kept_min.has_value()) check_row_vector("kept_min", *kept_min, logits, layout.rows, at::kFloat);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto opts = logits.options().dtype(at::kFloat);
  // The outputs take the targets' shape (the token shape), so no caller needs a view of them.
  at::Tensor logp = at::empty(targets.sizes(), opts);
  at::Tensor entropy = at::empty(targets.sizes(), opts);
  at::Tensor lse = at::empty(targets.sizes(), opts);
  if (layout.rows == 0) return {logp, entropy, lse};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  GSPO_DISPATCH_LOGITS(logits.scalar_type(), "gspo_kernels::token_stats", [&] {
    const TokenStatsArgs<scalar_t> args{logits.const_data_ptr<scalar_t>(), targets.const_data_ptr<int64_t>(),
                                        logp.data_ptr<float>(), entropy.data_ptr<float>(), lse.data_ptr<float>(),
                                        layout, map,
                                        kept_min.has_value() ? kept_min->const_data_ptr<float>() : nullptr};
    with_kernel_shape<scalar_t>(rows_16b_aligned<scalar_t>(args.logits, layout), layout.vocab,
                                TokenStatsLaunch<scalar_t>{args, stream});
  });
  return {logp, entropy, lse};
}

void launch_grad(const at::Tensor& logits, at::Tensor& grad, const GradInputs& g_in, const LogitMap& map) {
  check_logits(logits, c10::kCUDA);
  TORCH_CHECK(grad.device() == logits.device() && grad.scalar_type() == logits.scalar_type() &&
                  grad.sizes() == logits.sizes(),
              "gspo_kernels: the gradient buffer must match the logits");
  const RowLayout in = row_layout(logits);
  const RowLayout out = row_layout(grad);
  g_in.check(logits, in.rows);
  if (in.rows == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  GSPO_DISPATCH_LOGITS(logits.scalar_type(), "gspo_kernels::logits_grad", [&] {
    const bool has_h = g_in.grad_entropy.has_value();
    const GradArgs<scalar_t> args{logits.const_data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), in, out,
                                  g_in.targets.const_data_ptr<int64_t>(), g_in.lse.const_data_ptr<float>(),
                                  g_in.entropy.const_data_ptr<float>(), g_in.grad_logp.const_data_ptr<float>(),
                                  has_h ? g_in.grad_entropy->const_data_ptr<float>() : nullptr,
                                  g_in.row_mask.has_value() ? g_in.row_mask->const_data_ptr<bool>() : nullptr,
                                  map, g_in.kept_min.has_value() ? g_in.kept_min->const_data_ptr<float>() : nullptr};
    const bool aligned = rows_16b_aligned<scalar_t>(args.logits, in) && rows_16b_aligned<scalar_t>(args.grad, out);
    with_kernel_shape<scalar_t>(aligned, in.vocab, GradLaunch<scalar_t>{args, stream});
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CUDA, m) {
  m.impl("token_stats", &token_stats);
  m.impl("logits_grad", &logits_grad_op<launch_grad>);
  m.impl("logits_grad_", &logits_grad_inplace_op<launch_grad>);
}

}  // namespace gspo::cuda
