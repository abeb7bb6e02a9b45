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
// the row and head strides, each head's hd elements contiguous.  The cache holds float32
// or, with `half`, IEEE binary16 (each element widened exactly as it is read).  O [M, H, hd].
struct AttendArgs {
  const float* Q;
  const void *K, *V;
  int64_t k_row, k_head, v_row, v_head;   // strides in elements
  int64_t M, H, hd, pos0, rows;
  float c;                                // sqrt(hd) log2(e): scores in log2 units
  int64_t k_begin = 0, k_end = 0;         // the keys one walk reduces: a chunk (attend_rows sets it)
  bool half = false;                      // K and V elements are binary16 (uint16_t bits)
  int64_t visible(int64_t m) const { return pos0 + m + 1 < rows ? pos0 + m + 1 : rows; }
  template <class E>
  const E* key(int64_t w, int64_t h) const { return static_cast<const E*>(K) + w * k_row + h * k_head; }
  template <class E>
  const E* value(int64_t w, int64_t h) const { return static_cast<const E*>(V) + w * v_row + h * v_head; }
};
// binary16 bits -> float, exactly (subnormals, infinities and NaNs included)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  union { uint32_t u; float f; } r;
  if (e == 0x1fu) {
    r.u = sign | 0x7f800000u | (man << 13);
  } else if (e != 0) {
    r.u = sign | ((e + 112u) << 23) | (man << 13);
  } else {   // zero or subnormal: man * 2^-24, exact in float
    r.f = static_cast<float>(man) * 5.9604644775390625e-8f;
    r.u |= sign;
  }
  return r.f;
}
void attend_rows(const AttendArgs& args, float* O);
// attend_rows over `rows` keys comes soon (the helper thread, if it will share it, wakes)
void attend_coming(int64_t rows);

}  // namespace spel
