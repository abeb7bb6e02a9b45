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

}  // namespace spel
