// The sampler's kept set one row at a time (kept_set.cpp), for the two ops that select: the
// thresholds alone (kept_set.cpp) and the forward that selects as it goes (kernels.cpp).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

#include "../gspo_math.h"

namespace gspo::cpu {

struct SamplingFilter {
  int64_t top_k;  // <= 0: none
  double top_p;   // >= 1: none
  double min_p;   // <= 0: none
};

// The filter from the ops' arguments, checked.
SamplingFilter sampling_filter(int64_t top_k, double top_p, double min_p);

// One row's kept set: the threshold on its raw logits (-inf: every token kept), and, where the
// selection summed the kept set's softmax on its way (`summed`: top-p's cut found on the masses,
// no soft-cap, some token dropped), those sums as the forward kernel's stats.
struct KeptRow {
  float threshold;
  bool summed;
  SoftmaxStats stats;
};

// Selects row after row with one thread's scratch (a float32 copy of a row and its masses).
// with_stats: fill KeptRow::stats where the selection can (a few operations a logit more).
class KeptSelector {
 public:
  KeptSelector(const LogitMap& map, const SamplingFilter& filter, bool with_stats);
  ~KeptSelector();
  KeptSelector(const KeptSelector&) = delete;
  KeptSelector& operator=(const KeptSelector&) = delete;

  KeptRow operator()(const float* row, int64_t vocab);
  KeptRow operator()(const at::BFloat16* row, int64_t vocab);
  KeptRow operator()(const at::Half* row, int64_t vocab);

 private:
  struct Scratch;
  LogitMap map_;
  SamplingFilter filter_;
  bool with_stats_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace gspo::cpu
