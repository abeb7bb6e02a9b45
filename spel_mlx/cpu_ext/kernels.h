// The kernels one family's file lends to another: the fused sub-blocks (blocks.cpp,
// attention.cpp) run these same bodies in the same order, so they give the same bits
// as the separate primitives.
#pragma once

#include <cstdint>

#include "common.h"

namespace spel {

// linear.cpp: Y [M, nb*rb] = X [M, d_in] (contiguous) times the row blocks [nb, d_in, rb]
void linear_into(const float* X, int64_t M, const mx::array& blocks, float* Y);

// norm_gate.cpp
void rms_rows(const float* X, const float* w, float* Y, int64_t R, int64_t d, float eps);
void silu_mul_row(const float* a, const float* b, float* y, int64_t n);

// conv_delta.cpp: u = silu(causal 3-tap conv over [tail; x]) [M, d] and the M tails
// [M, 2, d]; the delta rule from the raw projection X [M, 3*H*hd] (q, k L2-normalized,
// written to Qo, Ko): o [M, H, hd], every token's state SA [M, H, hd, hd]
void conv_body(const View& X, const View& T, const View& C, int64_t M, int64_t d, float* U, float* TL);
void gdn_delta_body(const View& X, const View& A, const View& B, const View& S0v, int64_t M, int64_t H,
                    int64_t hd, float* O, float* SA, float* Qo, float* Ko);

// attend_blocked.cpp: causal attention of M queries Q [M, H, hd] (contiguous) over the
// cache rows 0 .. pos0+m of query m (at most `rows`); a row's heads are read through
// the row and head strides, each head's hd elements contiguous.  O [M, H, hd].
struct AttendArgs {
  const float *Q, *K, *V;
  int64_t k_row, k_head, v_row, v_head;   // strides in elements
  int64_t M, H, hd, pos0, rows;
  float c;                                // sqrt(hd) log2(e): scores in log2 units
  int64_t k_begin = 0, k_end = 0;         // the keys one walk reduces: a chunk (attend_rows sets it)
  int64_t visible(int64_t m) const { return pos0 + m + 1 < rows ? pos0 + m + 1 : rows; }
  const float* key(int64_t w, int64_t h) const { return K + w * k_row + h * k_head; }
  const float* value(int64_t w, int64_t h) const { return V + w * v_row + h * v_head; }
};
void attend_rows(const AttendArgs& args, float* O);
// attend_rows over `rows` keys comes soon (the helper thread, if it will share it, wakes)
void attend_coming(int64_t rows);

}  // namespace spel
