// The products of fused linear over the engine's kept sets (gspo_kernels/linear/kept_products.py):
// for entries e = (row r_e, id v_e) of the sets, with x the logits and dx their gradient,
//
//   kept_dots          x[e]     = hidden[r_e] . weight[v_e]                     float32 (nnz,)
//   kept_hidden_grad   dh[r]    = sum_{e of row r} dx[e] * weight[v_e]          (N, H)
//   kept_weight_grad   dW[v]    = sum_{e of id v} dx[e] * hidden[r_e]           (V, H), and db[v]
//
// The logits and d hidden read the sets in their own (CSR) order, each row's ids ascending
// (KeptTokens holds them so): a tile of rows against the weight a block of ids at a time
// (rows_by_id_block), so that the block's weight rows stay in L2 while each row takes its
// entries in the block. d weight needs the entries by id: kept_group orders them by block of rows,
// then by id, then by row (a counting sort per block), carrying dx into that grouped order; each
// weight row's sum then reads its rows' hidden rows block after block.
//
// On a 2-core AMX Xeon (N = 2048, H = 512, V = 32768, 512 random ids a row) the logits took
// 42.6 ms by token row without blocks (a random weight row from L3 for each entry), 25.1 ms by id
// alone, 11.0 ms grouped by block of rows and id after a 4.3 ms grouping pass, and 13.9 ms by tile
// of rows and block of ids with no pass (forward + backward at k = 512: 74.7 ms grouped, 70.7 ms
// so). d hidden took 22.8 ms grouped (each entry adding into a row's float32 sum held in L2, 4 KiB
// moved) and 18.4 ms by tile and block (a weight row read from L2).
//
// Every sum runs in a fixed order whatever the blocks and threads: dh[r] over its ids ascending,
// dW[v] over its rows ascending, in float32, rounded once to the operands' dtype. So the bits do
// not depend on the thread count, the block size, or the other rows (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../op_common.h"
#include "huge_pages.h"
#include "row_vec.h"

// AVX512-BF16's dot on x86 where the compiler can target it per function and ask the CPU at run
// time (GCC 11+, clang), whatever the build's SIMD level.
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define GSPO_BF16_DOT 1
#include <immintrin.h>
#endif

namespace gspo::cpu {
namespace {

constexpr int64_t kDotsAtOnce = 4;  // dot products interleaved: independent FMA chains hide their latency

inline void widen(const float* src, float* dst, int64_t n) { std::copy_n(src, n, dst); }
template <typename half_t>
inline void widen(const half_t* src, float* dst, int64_t n) {
  const int64_t n_vec = n - n % (2 * Vec::size());
  for (int64_t i = 0; i < n_vec; i += 2 * Vec::size()) {
    Vec a, b;
    load_pair(src + i, a, b);
    a.store(dst + i);
    b.store(dst + i + Vec::size());
  }
  for (int64_t i = n_vec; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Two float32 vectors from p[0 : 2 * Vec::size()].
inline void load2(const float* p, Vec& a, Vec& b) {
  a = Vec::loadu(p);
  b = Vec::loadu(p + Vec::size());
}
template <typename half_t>
inline void load2(const half_t* p, Vec& a, Vec& b) {
  load_pair(p, a, b);
}

// out[j] = x . t[j] for kCount rows t[j] of width h; x float32. kCount is a constant so that the
// accumulators stay in registers.
template <int64_t kCount, typename scalar_t>
void dots(const float* x, const scalar_t* const* t, int64_t h, float* out) {
  constexpr int64_t kW = 2 * Vec::size();
  const int64_t h_vec = h - h % kW;
  Vec acc[kCount][2];
  for (auto& a : acc) a[0] = a[1] = Vec(0.f);
  for (int64_t i = 0; i < h_vec; i += kW) {
    const Vec x0 = Vec::loadu(x + i), x1 = Vec::loadu(x + i + Vec::size());
    for (int64_t j = 0; j < kCount; ++j) {
      Vec a, b;
      load2(t[j] + i, a, b);
      acc[j][0] = at::vec::fmadd(a, x0, acc[j][0]);
      acc[j][1] = at::vec::fmadd(b, x1, acc[j][1]);
    }
  }
  for (int64_t j = 0; j < kCount; ++j) {
    float s = sum_lanes(acc[j][0] + acc[j][1]);
    for (int64_t i = h_vec; i < h; ++i) s += x[i] * static_cast<float>(t[j][i]);
    out[j] = s;
  }
}

template <typename scalar_t>
void dots_of_count(const float* x, const scalar_t* const* t, int64_t count, int64_t h, float* out) {
  static_assert(kDotsAtOnce == 4);
  switch (count) {
    case 1: return dots<1>(x, t, h, out);
    case 2: return dots<2>(x, t, h, out);
    case 3: return dots<3>(x, t, h, out);
    default: return dots<4>(x, t, h, out);
  }
}

#ifdef GSPO_BF16_DOT
// The same for bf16 x and t with AVX512-BF16's dot instruction (pairs of bf16 products added into
// float32 lanes, no widening): where the CPU has it, whatever the build's SIMD level. 2.6x faster
// than dots() on a 2-core AMX Xeon (N = 2048, H = 512, 512 ids a row). There it runs at about
// half the instruction's peak (1.68G a second a core), bound by the hidden rows' reads from L2
// (1 KiB an entry): 11.0 ms for the logits, where batches of 8 entries across segment ends, each
// with its own weight row, took 12.1 ms.
template <int64_t kCount>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dots_bf16_n(const c10::BFloat16* x, const c10::BFloat16* const* t,
                                                                        int64_t h, float* out) {
  constexpr int64_t kW = 64;  // two 32-lane bf16 vectors a step
  const int64_t h_vec = h - h % kW;
  __m512 acc[kCount][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < h_vec; i += kW) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + i), x1 = (__m512bh)_mm512_loadu_si512(x + i + 32);
    for (int64_t j = 0; j < kCount; ++j) {
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)_mm512_loadu_si512(t[j] + i), x0);
      acc[j][1] = _mm512_dpbf16_ps(acc[j][1], (__m512bh)_mm512_loadu_si512(t[j] + i + 32), x1);
    }
  }
  for (int64_t j = 0; j < kCount; ++j) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]));
    for (int64_t i = h_vec; i < h; ++i) s += static_cast<float>(x[i]) * static_cast<float>(t[j][i]);
    out[j] = s;
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dots_bf16(const c10::BFloat16* x, const c10::BFloat16* const* t,
                                                                        int64_t count, int64_t h, float* out) {
  switch (count) {
    case 1: return dots_bf16_n<1>(x, t, h, out);
    case 2: return dots_bf16_n<2>(x, t, h, out);
    case 3: return dots_bf16_n<3>(x, t, h, out);
    default: return dots_bf16_n<4>(x, t, h, out);
  }
}

// GSPO_CPU_BF16_DOT=0 turns it off (the tests run the other path on a CPU that has it).
bool has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") &&
                          !(std::getenv("GSPO_CPU_BF16_DOT") != nullptr && std::string(std::getenv("GSPO_CPU_BF16_DOT")) == "0");
  return yes;
}
#else
bool has_bf16_dot() { return false; }
void dots_bf16(const c10::BFloat16*, const c10::BFloat16* const*, int64_t, int64_t, float*) {}
#endif

// The dot products of one weight row (w_row, widened into `row` unless bf16_dot) with `count` hidden rows.
template <typename scalar_t>
void entry_dots(const scalar_t*, const float* row, const scalar_t* const* t, int64_t count, int64_t h, float* out,
                bool) {
  dots_of_count(row, t, count, h, out);
}
inline void entry_dots(const c10::BFloat16* w_row, const float* row, const c10::BFloat16* const* t, int64_t count,
                       int64_t h, float* out, bool bf16_dot) {
  if (bf16_dot) {
    dots_bf16(w_row, t, count, h, out);
  } else {
    dots_of_count(row, t, count, h, out);
  }
}

// Float32 vectors per chunk of a row held in registers by the sums below (128 floats with AVX-512).
constexpr int64_t kChunkVecs = 8;
constexpr int64_t kChunk = kChunkVecs * Vec::size();

// acc[0:h] += c_j * t_j[0:h] for `count` rows t_j = row(j), added one after another in j's
// order, a chunk of acc at a time in registers (one rounding a product-add).
template <typename Row>
void add_rows(const float* c, const Row& row, int64_t count, int64_t h, float* acc) {
  const int64_t h_vec = h - h % kChunk;
  for (int64_t i = 0; i < h_vec; i += kChunk) {
    Vec sum[kChunkVecs];
    for (int64_t q = 0; q < kChunkVecs; ++q) sum[q] = Vec::loadu(acc + i + q * Vec::size());
    for (int64_t j = 0; j < count; ++j) {
      const Vec vc(c[j]);
      const auto* t = row(j) + i;
      for (int64_t q = 0; q < kChunkVecs; q += 2) {
        Vec a, b;
        load2(t + q * Vec::size(), a, b);
        sum[q] = at::vec::fmadd(a, vc, sum[q]);
        sum[q + 1] = at::vec::fmadd(b, vc, sum[q + 1]);
      }
    }
    for (int64_t q = 0; q < kChunkVecs; ++q) sum[q].store(acc + i + q * Vec::size());
  }
  for (int64_t i = h_vec; i < h; ++i) {
    float s = acc[i];
    for (int64_t j = 0; j < count; ++j) s = std::fma(c[j], static_cast<float>(row(j)[i]), s);
    acc[i] = s;
  }
}

// Round to nearest even (NaN stays NaN), vectorized (a scalar loop took ~3 ms of d weight's
// 32768 rows of 512 on a 2-core AMX Xeon).
template <typename scalar_t>
void round_into(const float* acc, scalar_t* dst, int64_t n) {
  at::vec::convert(acc, dst, n);
}

void check_index(const char* op, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1, op, ": ",
              name, " must be a contiguous 1-D int64 CPU tensor");
}

void check_matrix(const char* op, const at::Tensor& t, const char* name, int64_t h) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() && t.size(1) == h, op, ": ", name,
              " must be a contiguous (rows, ", h, ") CPU matrix");
}

// The grouping of one call: segments (block b, id v) at offsets[b * V + v]; grouped entry e is in
// row rows[e], its dx at grouped_dx[e] (kept_group carries dx there as it places each entry: a
// gather by a separate order took 2.6 ms more a k = 512 step, 2-core AVX512-BF16 EPYC). d weight
// reads rows[] and dx in grouped order, one after another: reading them through the entries'
// order (a random access each) measured slower.
struct Groups {
  const int64_t* offsets;
  const int64_t* rows;
  int64_t entries, vocab, blocks, block_rows;

  static Groups of(const char* op, const at::Tensor& offsets, const at::Tensor& rows, int64_t vocab,
                   int64_t block_rows) {
    check_index(op, offsets, "offsets");
    check_index(op, rows, "rows");
    TORCH_CHECK(block_rows >= 1 && vocab >= 1 && (offsets.numel() - 1) % vocab == 0, op,
                ": offsets must have blocks * vocab + 1 entries");
    return {offsets.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), rows.numel(), vocab,
            (offsets.numel() - 1) / vocab, block_rows};
  }
};

void check_grouped_dx(const char* op, const at::Tensor& dx, const Groups& g) {
  TORCH_CHECK(dx.scalar_type() == at::kFloat && dx.is_contiguous() && dx.numel() == g.entries, op,
              ": dx must be contiguous float32, one per entry, in grouped order");
}

// The CSR of a call (row offsets, N + 1 of them from 0 to nnz, and the ids), cut into tiles of
// tile_rows rows that rows_by_id_block walks a block of block_ids ids at a time.
struct Rows {
  const int64_t* offsets;
  const int64_t* ids;
  int64_t rows, entries, tile_rows, block_ids, tiles;

  static Rows of(const char* op, const at::Tensor& row_offsets, const at::Tensor& ids, int64_t tile_rows,
                 int64_t block_ids) {
    check_index(op, row_offsets, "row_offsets");
    check_index(op, ids, "ids");
    TORCH_CHECK(tile_rows >= 1 && block_ids >= 1, op, ": tile_rows and block_ids must be >= 1");
    const int64_t rows = row_offsets.numel() - 1;
    const int64_t* off = row_offsets.data_ptr<int64_t>();
    TORCH_CHECK(rows >= 0 && off[0] == 0 && off[rows] == ids.numel(), op, ": row_offsets must run from 0 to nnz");
    return {off, ids.data_ptr<int64_t>(), rows, ids.numel(), tile_rows, block_ids, (rows + tile_rows - 1) / tile_rows};
  }

  int64_t first_row(int64_t tile) const { return tile * tile_rows; }
  int64_t rows_of(int64_t tile) const { return std::min(tile_rows, rows - first_row(tile)); }
};

// The sets in their own (CSR) order, each row's ids ascending, for the logits and d hidden: a tile
// of rows against the weight a block of block_ids ids at a time, so that the block's rows stay in
// L2 while each row takes the block's entries from a cursor (its ids ascending, they are
// consecutive): visit(j, first, last) for the tile's row j and its entries [first, last) in a
// block. Rows not sorted are still visited whole, in their order.
template <typename Visit>
void rows_by_id_block(const char* op, const Rows& r, int64_t tile, int64_t vocab, std::vector<int64_t>& cursor,
                      const Visit& visit) {
  const int64_t first_row = r.first_row(tile), n_rows = r.rows_of(tile);
  cursor.assign(r.offsets + first_row, r.offsets + first_row + n_rows);
  for (int64_t first_id = 0; first_id < vocab; first_id += r.block_ids) {
    const int64_t stop = first_id + r.block_ids >= vocab ? INT64_MAX : first_id + r.block_ids;
    for (int64_t j = 0; j < n_rows; ++j) {
      const int64_t first = cursor[j], last = r.offsets[first_row + j + 1];
      int64_t e = first;
      for (; e < last && r.ids[e] < stop; ++e) {
        TORCH_CHECK(r.ids[e] >= 0 && r.ids[e] < vocab, op, ": id ", r.ids[e], " outside [0, ", vocab, ")");
      }
      if (e == first) continue;
      cursor[j] = e;
      visit(j, first, e);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kept_group(const at::Tensor& row_offsets, const at::Tensor& ids,
                                                          const at::Tensor& dx, int64_t vocab, int64_t block_rows) {
  const char* op = "gspo_kernels::kept_group";
  check_index(op, row_offsets, "row_offsets");
  check_index(op, ids, "ids");
  TORCH_CHECK(vocab >= 1 && block_rows >= 1, op, ": vocab and block_rows must be >= 1");
  TORCH_CHECK(dx.device().is_cpu() && dx.scalar_type() == at::kFloat && dx.is_contiguous() && dx.numel() == ids.numel(),
              op, ": dx must be contiguous float32 CPU, one per entry");
  const int64_t rows = row_offsets.numel() - 1;
  const int64_t blocks = std::max<int64_t>(1, (rows + block_rows - 1) / block_rows);
  at::Tensor offsets = at::empty({blocks * vocab + 1}, ids.options());
  at::Tensor grouped_dx = at::empty({ids.numel()}, dx.options());
  at::Tensor grouped_rows = at::empty({ids.numel()}, ids.options());
  int64_t* grows = grouped_rows.data_ptr<int64_t>();
  const int64_t* row_off = row_offsets.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  const float* d = dx.data_ptr<float>();
  float* gdx = grouped_dx.data_ptr<float>();
  off[blocks * vocab] = ids.numel();
  // Each block's entries are contiguous (rows are): a counting sort of its own, in parallel.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> next(vocab);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first_row = std::min(b * block_rows, rows), last_row = std::min((b + 1) * block_rows, rows);
      const int64_t first = row_off[first_row], last = row_off[last_row];
      std::fill(next.begin(), next.end(), 0);
      for (int64_t e = first; e < last; ++e) {
        TORCH_CHECK(id[e] >= 0 && id[e] < vocab, op, ": id ", id[e], " outside [0, ", vocab, ")");
        ++next[id[e]];
      }
      int64_t at_ = first;
      for (int64_t v = 0; v < vocab; ++v) {
        const int64_t count = next[v];
        off[b * vocab + v] = at_;
        next[v] = at_;
        at_ += count;
      }
      for (int64_t r = first_row; r < last_row; ++r) {
        for (int64_t e = row_off[r]; e < row_off[r + 1]; ++e) {
          const int64_t at_e = next[id[e]]++;
          gdx[at_e] = d[e];
          grows[at_e] = r;
        }
      }
    }
  });
  return {grouped_dx, offsets, grouped_rows};
}

// The logits of the entries in their own order (rows_by_id_block), each row's hidden row held
// (widened once a tile where the products are float32 FMAs) against the block's weight rows.
at::Tensor kept_dots(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& row_offsets,
                     const at::Tensor& ids, int64_t tile_rows, int64_t block_ids) {
  const char* op = "gspo_kernels::kept_dots";
  const int64_t h = hidden.size(-1), vocab = weight.size(0);
  check_matrix(op, hidden, "hidden", h);
  check_matrix(op, weight, "weight", h);
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), op, ": hidden and weight must share a dtype");
  const Rows r = Rows::of(op, row_offsets, ids, tile_rows, block_ids);
  TORCH_CHECK(hidden.size(0) == r.rows, op, ": hidden must have one row per row of the sets");
  at::Tensor out = at::empty({r.entries}, hidden.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  GSPO_DISPATCH_LOGITS(hidden.scalar_type(), "gspo_kernels::kept_products", [&] {
    const scalar_t* hid = hidden.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const bool bf16_dot = std::is_same_v<scalar_t, c10::BFloat16> && has_bf16_dot();
    at::parallel_for(0, r.tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(bf16_dot ? 0 : static_cast<size_t>(r.tile_rows * h));
      std::vector<int64_t> cursor;
      const scalar_t* t[kDotsAtOnce];
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t first_row = r.first_row(tile);
        if (!bf16_dot) widen(hid + first_row * h, widened.data(), r.rows_of(tile) * h);
        rows_by_id_block(op, r, tile, vocab, cursor, [&](int64_t j, int64_t first, int64_t last) {
          const scalar_t* h_row = hid + (first_row + j) * h;
          for (int64_t e = first; e < last; e += kDotsAtOnce) {
            const int64_t count = std::min(kDotsAtOnce, last - e);
            for (int64_t q = 0; q < count; ++q) t[q] = w + r.ids[e + q] * h;
            entry_dots(h_row, bf16_dot ? nullptr : widened.data() + j * h, t, count, h, dst + e, bf16_dot);
          }
        });
      }
    });
  });
  return out;
}

// d hidden by tile and block (rows_by_id_block): a tile's sums (float32, tile_rows x H) are its
// own, and each row adds its entries onto its sum a chunk of registers at a time, in their order.
at::Tensor kept_hidden_grad(const at::Tensor& dx, const at::Tensor& weight, const at::Tensor& row_offsets,
                            const at::Tensor& ids, int64_t tile_rows, int64_t block_ids, bool round) {
  const char* op = "gspo_kernels::kept_hidden_grad";
  const int64_t h = weight.size(-1), vocab = weight.size(0);
  check_matrix(op, weight, "weight", h);
  const Rows r = Rows::of(op, row_offsets, ids, tile_rows, block_ids);
  TORCH_CHECK(dx.scalar_type() == at::kFloat && dx.is_contiguous() && dx.numel() == r.entries, op,
              ": dx must be contiguous float32, one per entry");
  at::Tensor out = at::empty({r.rows, h}, weight.options().dtype(round ? weight.scalar_type() : at::kFloat));
  const float* d = dx.data_ptr<float>();
  GSPO_DISPATCH_LOGITS(weight.scalar_type(), "gspo_kernels::kept_products", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    // A tile a task: its rows' sums are its own (no two threads add into one row).
    at::parallel_for(0, r.tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(static_cast<size_t>(r.tile_rows * h));
      std::vector<int64_t> cursor;
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t first_row = r.first_row(tile), n_rows = r.rows_of(tile);
        std::fill_n(acc.data(), n_rows * h, 0.f);
        rows_by_id_block(op, r, tile, vocab, cursor, [&](int64_t j, int64_t first, int64_t last) {
          const int64_t* ids = r.ids + first;
          add_rows(d + first, [&](int64_t q) { return w + ids[q] * h; }, last - first, h, acc.data() + j * h);
        });
        if (round) {
          round_into(acc.data(), out.data_ptr<scalar_t>() + first_row * h, n_rows * h);
        } else {
          std::copy_n(acc.data(), n_rows * h, out.data_ptr<float>() + first_row * h);
        }
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> kept_weight_grad(const at::Tensor& dx, const at::Tensor& hidden,
                                                    const at::Tensor& offsets, const at::Tensor& grouped_rows,
                                                    int64_t vocab, int64_t block_rows) {
  const char* op = "gspo_kernels::kept_weight_grad";
  const int64_t h = hidden.size(-1);
  check_matrix(op, hidden, "hidden", h);
  const Groups g = Groups::of(op, offsets, grouped_rows, vocab, block_rows);
  check_grouped_dx(op, dx, g);
  at::Tensor out = at::empty({vocab, h}, hidden.options());
  advise_huge_pages(out);  // every row is written, the unkept ids' with zeros
  at::Tensor bias = at::empty({vocab}, hidden.options().dtype(at::kFloat));
  const float* d = dx.data_ptr<float>();
  float* db = bias.data_ptr<float>();
  GSPO_DISPATCH_LOGITS(hidden.scalar_type(), "gspo_kernels::kept_products", [&] {
    const scalar_t* hid = hidden.const_data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    // An id a step: its rows' products summed a chunk at a time in registers, block after block,
    // the rows read through the grouped entries (gathering each id's coefficients and row
    // pointers into vectors first took 5% more, one thread of a 2-core AVX-512 Xeon). Tiling the
    // ids against blocks of rows, so that a block's hidden rows stay in L2, measured slower (46
    // against 35 ms on a 2-core AMX Xeon, N = 2048, H = 512, 512 ids a row): an id meets about 8
    // rows a block, too few to pay for reloading its sums. So did passes over slices of 128
    // columns, a slice of every hidden row then in L2 (59-83 against 47-57 ms, one thread, the
    // 2-core AVX-512 Xeon without BF16, whose L2 of 1.25 MiB holds no whole hidden matrix).
    at::parallel_for(0, vocab, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(h);
      for (int64_t v = begin; v < end; ++v) {
        std::fill(acc.begin(), acc.end(), 0.f);
        float bias_sum = 0.f;
        for (int64_t b = 0; b < g.blocks; ++b) {  // blocks in row order: the id's rows ascending
          const int64_t s = b * g.vocab + v, first = g.offsets[s], count = g.offsets[s + 1] - first;
          if (count == 0) continue;
          for (int64_t e = first; e < first + count; ++e) bias_sum += d[e];
          const int64_t* rows = g.rows + first;
          add_rows(d + first, [&](int64_t j) { return hid + rows[j] * h; }, count, h, acc.data());
        }
        db[v] = bias_sum;
        round_into(acc.data(), dst + v * h, h);
      }
    });
  });
  return {out, bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) {
  m.impl("kept_group", &kept_group);
  m.impl("kept_dots", &kept_dots);
  m.impl("kept_hidden_grad", &kept_hidden_grad);
  m.impl("kept_weight_grad", &kept_weight_grad);
}

}  // namespace gspo::cpu
