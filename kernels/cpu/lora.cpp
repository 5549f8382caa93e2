// LoRA deltas of a mixed-adapter step, gathered by adapter (Punica's SGMV in spirit), compiled into the same
// library as native.cpp (kernels/cpu_build.py builds both).
//
// One call per projection per layer adds every adapter's delta to its own rows of the step:
//   y[row] += (x[row] @ A_t) @ B_t   for each row of each group (one group per adapter in the step).
// Phase 1 (shrink) runs each group's rows in tiles of kTile, so a tile shares each load of A_t [K, R];
// phase 2 (expand) runs each group's B_t in column chunks, every row of the group over one chunk, so B_t is
// read once per group (not once per row as a per-row BGMV would). An adapter on a fused projection (q/k/v,
// gate/up) stacks its pieces' A columns and lays B block-diagonally (engine/lora/adapter.py); `cols` tells
// each piece's column range, and the expand skips the zero blocks.
//
// Plain loops that GCC vectorizes over the rank (shrink) and the columns (expand) at -O3 -march=native; the
// Python side (kernels/cpu_lora.py) checks shapes and dtypes before passing pointers on.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

extern "C" {

struct sf_lora_weights {
  const float* a_t;  // [K, R] contiguous: the pieces' A^T stacked along R
  const float* b_t;  // [R, N] contiguous: block-diagonal B^T, the scale folded in
  int64_t K, N, R;
  int64_t r;  // rank of each piece: R / r pieces, piece p owns rows [p r, (p + 1) r) of B_t
  const int64_t* cols;  // [R / r, 2]: piece p's output columns [cols[2p], cols[2p + 1])
};

}  // extern "C"

namespace {

constexpr int64_t kTile = 8;  // rows per shrink task: 8 rows share each A_t load (as native.cpp's linears)
constexpr int64_t kChunk = 128;  // columns per expand task: 8 rows x 128 floats of y stay in L1

struct Task {
  int64_t group, first, count;  // shrink: rows [first, first + count) of the group; expand: columns
  int64_t piece;
};

void shrink(const float* x, int64_t ldx, const sf_lora_weights& w, const int64_t* rows, int64_t n, float* s,
            int64_t lds) {
  float acc[kTile][512];  // R <= 512: the wrapper refuses larger (7 pieces x rank 64 = 448)
  const int64_t R = w.R;
  for (int64_t i = 0; i < n; ++i) std::fill(acc[i], acc[i] + R, 0.0f);
  for (int64_t k = 0; k < w.K; ++k) {
    const float* a = w.a_t + k * R;
    for (int64_t i = 0; i < n; ++i) {
      const float xv = x[rows[i] * ldx + k];
      float* out = acc[i];
#pragma omp simd
      for (int64_t j = 0; j < R; ++j) out[j] += xv * a[j];
    }
  }
  for (int64_t i = 0; i < n; ++i) std::copy(acc[i], acc[i] + R, s + i * lds);
}

void expand(const float* s, int64_t lds, const sf_lora_weights& w, int64_t piece, int64_t c0, int64_t c1,
            const int64_t* rows, int64_t n, float* y, int64_t ldy) {
  const int64_t j0 = piece * w.r;
  for (int64_t i = 0; i < n; ++i) {
    float* out = y + rows[i] * ldy;
    const float* si = s + i * lds;
    for (int64_t j = j0; j < j0 + w.r; ++j) {
      const float sv = si[j];
      const float* b = w.b_t + j * w.N;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) out[c] += sv * b[c];
    }
  }
}

}  // namespace

extern "C" {

// x [T, K] (row stride ldx), y [T, N] (row stride ldy) updated in place. Groups g = 0..G-1 own rows
// rows[group_start[g] .. group_start[g + 1]) (int64 row indices, each row in at most one group); w[g] is
// the group's adapter on this projection, or null where the adapter leaves the projection alone.
void sf_lora_add_f32(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t G, const int64_t* group_start,
                     const int64_t* rows, const sf_lora_weights* const* w, int threads) {
  int64_t max_r = 0;
  std::vector<Task> shrinks, expands;
  for (int64_t g = 0; g < G; ++g) {
    if (w[g] == nullptr) continue;
    const sf_lora_weights& W = *w[g];
    max_r = std::max(max_r, W.R);
    for (int64_t i = group_start[g]; i < group_start[g + 1]; i += kTile)
      shrinks.push_back({g, i, std::min(kTile, group_start[g + 1] - i), 0});
    for (int64_t p = 0; p < W.R / W.r; ++p)
      for (int64_t c = W.cols[2 * p]; c < W.cols[2 * p + 1]; c += kChunk)
        expands.push_back({g, c, std::min(kChunk, W.cols[2 * p + 1] - c), p});
  }
  if (shrinks.empty()) return;
  std::vector<float> s(group_start[G] * max_r);  // [rows of the step, max R]: each row's shrunk x
  const int64_t n_shrink = static_cast<int64_t>(shrinks.size());
  const int64_t n_expand = static_cast<int64_t>(expands.size());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_shrink; ++t) {
      const Task& k = shrinks[t];
      shrink(x, ldx, *w[k.group], rows + k.first, k.count, s.data() + k.first * max_r, max_r);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_expand; ++t) {
      const Task& e = expands[t];
      const int64_t first = group_start[e.group];
      expand(s.data() + first * max_r, max_r, *w[e.group], e.piece, e.first, e.first + e.count, rows + first,
             group_start[e.group + 1] - first, y, ldy);
    }
  }
}

}  // extern "C"
