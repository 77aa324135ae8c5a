// acc += x for a float32 accumulator and a bf16 (or float32) addend of the same shape: the one
// pass the fused-linear path needs to sum a CPU's bf16 `d weight` products in float32. torch's
// mixed-dtype add_ first casts the addend into a fresh float32 buffer (15 ms for V x H =
// 32768 x 512 on a 2-core AMX Xeon, torch 2.14.1, most of it mapping the new pages) and then
// adds (8 ms); this reads each operand once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cstring>
#include <torch/library.h>

namespace gspo::cpu {
namespace {

void accumulate_(at::Tensor& acc, const at::Tensor& x) {
  TORCH_CHECK(acc.device().is_cpu() && x.device().is_cpu(), "gspo_kernels::accumulate_: CPU tensors only");
  TORCH_CHECK(acc.scalar_type() == at::kFloat, "gspo_kernels::accumulate_: the accumulator must be float32, got ",
              acc.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gspo_kernels::accumulate_: the addend must be bf16 or float32, got ", x.scalar_type());
  TORCH_CHECK(acc.sizes() == x.sizes(), "gspo_kernels::accumulate_: shapes differ: ", acc.sizes(), " and ",
              x.sizes());
  TORCH_CHECK(acc.is_contiguous() && x.is_contiguous(), "gspo_kernels::accumulate_: contiguous tensors only");
  float* dst = acc.data_ptr<float>();
  const int64_t n = acc.numel();
  // 64K elements a task: large enough that a thread's share streams, small enough to split.
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        // A bf16 is the high half of a float32: the widening is exact.
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof(value));
        dst[i] += value;
      }
    });
  } else {
    const float* src = x.const_data_ptr<float>();
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dst[i] += src[i];
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) { m.impl("accumulate_", &accumulate_); }

}  // namespace gspo::cpu
