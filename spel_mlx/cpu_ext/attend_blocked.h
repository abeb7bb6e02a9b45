// The pieces of blocked attention (attend_blocked.cpp) that its scalar reference and
// its SIMD variants share: the block size, the exp-free 2^t, the halving sum, the
// running state of a (query, head), and the walk over a chunk's key blocks that every
// variant follows (the canonical order is described at the top of attend_blocked.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace spel {
namespace blocked {


constexpr int BK = 16;   // keys per block (one AVX-512 vector of scores)

// 2^f on [0, 1) (the constants of model.silu_mul) and 2^t for t <= 0: floor, the
// Horner polynomial in fma, the exponent bits; 0 below 2^-64 (and for a NaN).  A key
// that far below the running max (which contributes 1) changes no sum, and flushing
// it keeps p * v clear of denormals, which cost ~100 cycles each.
const float EXP2_FRACTION[7] = {0.00021683440718334168f, 0.0012437936384230852f, 0.009679987095296383f,
                                0.05548214912414551f, 0.24023030698299408f, 0.6931468844413757f, 1.0f};
const float LOG2E = 1.4426950408889634f;
const float EXP2_MIN = -64.0f;

inline float exp2_nonpos(float t) {
  if (!(t >= EXP2_MIN)) return 0.0f;
  const float n = std::floor(t);
  const float f = t - n;
  float p = EXP2_FRACTION[0];
  for (int i = 1; i < 7; i++) p = std::fma(p, f, EXP2_FRACTION[i]);
  union { int32_t i; float f; } two_n;
  two_n.i = (static_cast<int32_t>(n) + 127) << 23;
  return p * two_n.f;
}

inline float halving_sum16(const float* a) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Per-(query, head) running state across blocks: max (log2 units), lanes of the sum, acc.
struct Running {
  std::vector<float> m, lanes, acc;
  void reset(int64_t n, int64_t hd) {
    m.assign(n, -INFINITY);
    lanes.assign(n * BK, 0.0f);
    acc.assign(n * hd, 0.0f);
  }
};

// A long cache streams from memory, and the walk below reads each row in pieces, one
// head at a time, which the hardware prefetchers do not follow.  One byte load per
// cache line of the block's K and V rows, in address order, first brings the block in
// as a stream (measured in docs/model.md; software prefetches did not).  Reads only.
constexpr int64_t TOUCH_FROM = 256;   // keys; a shorter cache stays in the caches
// Keys per chunk: an item of work for the helper thread (two cores stream the cache,
// docs/model.md); one chunk, up to this many keys, is not worth a hand-over.
constexpr int64_t CHUNK = 512;

template <class E>
inline void touch_block(const AttendArgs& A, int64_t b0, int64_t nb) {
  const int64_t bytes = sizeof(E) * A.hd;
  unsigned t = 0;
  for (int64_t w = b0; w < b0 + nb; w++)
    for (int64_t h = 0; h < A.H; h++) {   // whatever the strides, only the elements read later
      const unsigned char* k = reinterpret_cast<const unsigned char*>(A.key<E>(w, h));
      const unsigned char* v = reinterpret_cast<const unsigned char*>(A.value<E>(w, h));
      for (int64_t b = 0; b < bytes; b += 64) t |= k[b] | v[b];
      t |= k[bytes - 1] | v[bytes - 1];     // the line of the last element
    }
  asm volatile("" : : "r"(t));   // the loads are the point: keep them
}

// The walk every variant shares: the chunk's key blocks in order, then heads, then the
// queries that see the block; block(b0, nb, h, q, m_run, lanes, acc) does one (query, head),
// and pair(b0, h, r, r2), where given, two queries that both see the whole block (R's rows
// r and r2 = r + H), each with the operations `block` would do.
template <class E, class Block, class Pair = std::nullptr_t>
void walk(const AttendArgs& A, Running& R, Block block, Pair pair = nullptr) {
  const int64_t end = std::min(A.visible(A.M - 1), A.k_end);
  const bool touch = A.visible(A.M - 1) >= TOUCH_FROM;
  for (int64_t b0 = A.k_begin; b0 < end; b0 += BK) {
    if (touch) touch_block<E>(A, b0, std::min<int64_t>(BK, end - b0));
    for (int64_t h = 0; h < A.H; h++)
      for (int64_t m = 0; m < A.M; m++) {
        const int64_t nb = std::min<int64_t>(BK, std::min(A.visible(m), A.k_end) - b0);
        if (nb <= 0) continue;
        const int64_t r = m * A.H + h;
        if constexpr (!std::is_same<Pair, std::nullptr_t>::value) {
          if (nb == BK && m + 1 < A.M && std::min(A.visible(m + 1), A.k_end) - b0 >= BK) {
            pair(b0, h, r, r + A.H);
            m++;
            continue;
          }
        }
        block(b0, nb, h, A.Q + r * A.hd, R.m[r], R.lanes.data() + r * BK, R.acc.data() + r * A.hd);
      }
  }
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return half_to_float(x); }

}  // namespace blocked
}  // namespace spel
