// The op schemas, declared once; the CPU and CUDA files register their implementations.
#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(gspo_kernels, m) {
  // Stage 1: per row, log_softmax(z) at the target, the entropy, and the logsumexp kept for
  // stage 3, z the logit map (gspo_math.h, LogitMap): inv_temperature * x, or with softcap > 0
  // softcap * tanh(inv_temperature * x). kept_min (float32, one per row, or None): the sampler's
  // kept set, x >= kept_min; the other logits count as -inf, and a target among them gets a
  // -inf log-prob. Each output is a float32 (rows,) vector.
  m.def(
      "token_stats(Tensor logits, Tensor targets, float inv_temperature, float softcap=0., "
      "Tensor? kept_min=None) -> (Tensor, Tensor, Tensor)");
  // Stage 3: dLoss/dlogits from dLoss/dlogp and dLoss/dentropy, in the logits' dtype.
  // row_mask (bool, one per row; None = every row) marks the rows in the loss: the others get
  // exact zeros without being read. A row in the loss whose softmax is not finite or whose
  // target is out of range gets NaN throughout.
  m.def(
      "logits_grad(Tensor logits, Tensor targets, Tensor lse, Tensor entropy, Tensor grad_logp, "
      "Tensor? grad_entropy, Tensor? row_mask, float inv_temperature, float softcap=0., "
      "Tensor? kept_min=None) -> Tensor");
  // The same, written over the logits (whose rows must not share memory).
  m.def(
      "logits_grad_(Tensor(a!) logits, Tensor targets, Tensor lse, Tensor entropy, Tensor grad_logp, "
      "Tensor? grad_entropy, Tensor? row_mask, float inv_temperature, float softcap=0., "
      "Tensor? kept_min=None) -> ()");
  // The sampler's kept set (token_stats/kept_set.py): per row, the threshold t on the raw logits
  // such that the tokens kept by min-p, then top-k, then top-p are those with x >= t (-inf: every
  // token kept), float32 of the logits' leading shape. top_k <= 0, top_p >= 1, min_p <= 0: unused.
  m.def("kept_thresholds(Tensor logits, float inv_temperature, float softcap, int top_k, float top_p, "
        "float min_p) -> Tensor");
  // Stage 1 with that kept set selected as each row is read (CPU): token_stats' three outputs
  // over each row's kept set, then the thresholds kept_thresholds would give, for stage 3.
  m.def("sampled_token_stats(Tensor logits, Tensor targets, float inv_temperature, float softcap, int top_k, "
        "float top_p, float min_p) -> (Tensor, Tensor, Tensor, Tensor)");
  // Stage 2, packed layout: per-sequence sums of (N,) or (N, k) values over the rows
  // cu_seqlens[s] .. cu_seqlens[s + 1], accumulated in float64 and returned in the values'
  // dtype, (S,) or (S, k) (0 for an empty sequence).
  m.def("segment_sum(Tensor values, Tensor cu_seqlens) -> Tensor");
  // Stage 2, packed layout: each of `rows` rows takes its sequence's value, (S,) -> (rows,).
  m.def("segment_expand(Tensor values, Tensor cu_seqlens, int rows) -> Tensor");
  // Fused linear over the engine's kept sets (csrc/cpu/kept_products.cpp says what each computes):
  // the logits of the entries and d hidden from the sets in CSR order (tiles of rows, blocks of
  // ids); dx and the entries' rows grouped by block of rows and id (grouped dx, offsets, rows),
  // and from them d weight with d bias; each sum in a fixed order.
  m.def("kept_group(Tensor row_offsets, Tensor ids, Tensor dx, int vocab, int block_rows) -> (Tensor, Tensor, Tensor)");
  m.def("kept_dots(Tensor hidden, Tensor weight, Tensor row_offsets, Tensor ids, int tile_rows, int block_ids) "
        "-> Tensor");
  m.def("kept_hidden_grad(Tensor dx, Tensor weight, Tensor row_offsets, Tensor ids, int tile_rows, int block_ids, "
        "bool round) -> Tensor");
  m.def("kept_weight_grad(Tensor dx, Tensor hidden, Tensor offsets, Tensor rows, int vocab, int block_rows) "
        "-> (Tensor, Tensor)");
  // The softmax over each row's kept entries (csrc/cpu/kept_softmax.cpp): z float32 (nnz,), CSR
  // rows by offsets, target_pos the target's entry per row or -1 (kept_target_positions: a
  // row's first id equal to its target); the per-row statistics, and each
  // entry's gradient under the kernels' row rule and the logit map's slope.
  m.def("kept_target_positions(Tensor offsets, Tensor ids, Tensor targets) -> Tensor");
  m.def("kept_softmax_stats(Tensor z, Tensor offsets, Tensor target_pos) -> (Tensor, Tensor, Tensor)");
  m.def("kept_softmax_grad(Tensor z, Tensor offsets, Tensor target_pos, Tensor lse, Tensor entropy, "
        "Tensor grad_logp, Tensor? grad_entropy, Tensor? row_mask, float inv_temperature, float softcap) -> Tensor");
  // Fused linear on a CPU: acc (float32) += x (bf16 or float32, the same shape), in one pass.
  m.def("accumulate_(Tensor(a!) acc, Tensor x) -> ()");
}

namespace gspo::cpu {
// How many threads the CPU kernels' row split (at::parallel_for with their grain) runs on for a
// problem of `rows` rows of `vocab` logits: 1 when the extension was built without OpenMP.
int64_t row_threads(int64_t rows, int64_t vocab);
}  // namespace gspo::cpu

#ifndef GSPO_CPU_CAPABILITY_NAME
#define GSPO_CPU_CAPABILITY_NAME "DEFAULT"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gspo_kernels native ops (registered under torch.ops.gspo_kernels)";
#ifdef GSPO_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("cpu_capability") = GSPO_CPU_CAPABILITY_NAME;
#ifdef _OPENMP
  m.attr("with_openmp") = true;
#else
  m.attr("with_openmp") = false;
#endif
  m.def("row_threads", &gspo::cpu::row_threads, "threads the CPU kernels' row split uses at (rows, vocab)",
        pybind11::arg("rows"), pybind11::arg("vocab"));
}
