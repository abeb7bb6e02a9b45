// Causal attention of M queries over a KV cache, blocked over keys with an online
// softmax (flash-style): each block of BK = 16 cache rows is read once for all M
// queries, the causal mask is applied inside the block, and exp is the exp-free 2^t
// polynomial of model.silu_mul.  A scalar reference and AVX-512 / AVX2 variants that
// do the same float operations in the same order (identical bits; tests compare), each
// for a float32 cache and a binary16 one (elements widened exactly as they are read:
// the same arithmetic on the same values).
//
// The keys are cut into chunks of CHUNK absolute positions.  Each chunk is reduced from
// its own running state, walking its blocks 0, 16, 32, ... (every head of a block, so a
// walk reads whole cache rows in address order), and the chunks' states are merged in
// chunk order.  A query's result therefore does not depend on M or on its row in the
// batch (a K+1 pass gives each row the bits of the single-token pass), nor on which
// thread reduced a chunk: over a long cache the chunks are shared with a helper thread
// (helper.cpp).  Up to CHUNK keys there is one chunk and no merge.
//
// The canonical order, per (query m, head h), of one block [b0, b0 + nb) (nb <= BK):
//   score of key w: 16 lanes a[l] = fma chain over j of q[16j+l] k_w[16j+l] (lanes past
//     hd read 0), summed by the halving tree ((a[l] + a[l+8]) + ...), times c =
//     sqrt(hd) log2(e): scores are in log2 units;
//   mx = max(m_run, block max); alpha = 2^(m_run - mx); p_w = 2^(s_w - mx) (0 past nb);
//   lanes[w] = fma(lanes[w], alpha, p_w);
//   acc[d] = fma(acc[d], alpha, even[d] + odd[d]), even/odd = fma chains over the
//     block's even / odd keys in order;
// merging chunk state (m', lanes', acc') into (m, lanes, acc): mx = max(m, m'),
//   a = 2^(m - mx), b = 2^(m' - mx), lanes = fma(lanes, a, lanes' b), acc = fma(acc, a, acc' b);
// and at the end o[d] = acc[d] / (halving tree of lanes).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attend_blocked.h"

namespace spel {
namespace {

using namespace blocked;

template <class E>
void attend_ref(const AttendArgs& A, Running& R) {
  const int64_t hd = A.hd, J = (hd + 15) / 16;
  std::vector<float> even(hd), odd(hd);
  walk<E>(A, R, [&](int64_t b0, int64_t nb, int64_t h, const float* q, float& m_run, float* lanes, float* acc) {
    float a[16], s[BK], p[BK];
    float top = -INFINITY;
    for (int64_t w = 0; w < nb; w++) {
      const E* k = A.key<E>(b0 + w, h);
      for (int l = 0; l < 16; l++) a[l] = l < hd ? q[l] * widen(k[l]) : 0.0f;
      for (int64_t j = 1; j < J; j++)
        for (int l = 0; l < 16; l++) {
          const int64_t i = 16 * j + l;
          a[l] = std::fma(i < hd ? q[i] : 0.0f, i < hd ? widen(k[i]) : 0.0f, a[l]);
        }
      s[w] = halving_sum16(a) * A.c;
      top = std::max(top, s[w]);
    }
    const float mx = std::max(m_run, top);
    const float alpha = exp2_nonpos(m_run - mx);
    m_run = mx;
    for (int w = 0; w < BK; w++) {
      p[w] = w < nb ? exp2_nonpos(s[w] - mx) : 0.0f;
      lanes[w] = std::fma(lanes[w], alpha, p[w]);
    }
    for (int64_t d = 0; d < hd; d++) even[d] = odd[d] = 0.0f;
    for (int64_t w = 0; w < nb; w++) {
      const E* v = A.value<E>(b0 + w, h);
      float* e = (w & 1) ? odd.data() : even.data();
      for (int64_t d = 0; d < hd; d++) e[d] = std::fma(p[w], widen(v[d]), e[d]);
    }
    for (int64_t d = 0; d < hd; d++) acc[d] = std::fma(acc[d], alpha, even[d] + odd[d]);
  });
}

#if SPEL_AVX2
#define SPEL_TARGET_AVX2_FMA __attribute__((target("avx2,fma,f16c")))
const bool HAVE_FMA = __builtin_cpu_supports("fma");
const bool HAVE_F16C = __builtin_cpu_supports("f16c");

// 16 (AVX-512, masked) or 8 (AVX2) elements as floats; a binary16 cache only in whole
// 16-element chunks (hd % 16 == 0: the dispatch checks), widened exactly
SPEL_TARGET_AVX512 inline __m512 load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
SPEL_TARGET_AVX512 inline __m512 load16(__mmask16, const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SPEL_TARGET_AVX2_FMA inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SPEL_TARGET_AVX2_FMA inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// --- AVX-512: one vector of 16 scores per block ----------------------------------------
// The halving tree of 16 keys' lane vectors, folded in as the keys come (no more than
// a few vectors live): pair1 sums lanes l + (l+8) of keys 2i, 2i+1 (key 2i in lanes
// 0..7); pair2 then + 4 (chunk c: key 4i+c); pair3 + 2 (chunk c: keys 8i+c, 8i+4+c);
// last + 1 (lane 4c+i: key c+4i), permuted into key order.
SPEL_TARGET_AVX512 inline __m512 pair1(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
SPEL_TARGET_AVX512 inline __m512 pair2(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
SPEL_TARGET_AVX512 inline __m512 pair3(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
SPEL_TARGET_AVX512 inline __m512 last_pair(__m512 a, __m512 b) {
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

SPEL_TARGET_AVX512 inline __m512 exp2_nonpos16(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(EXP2_MIN), _CMP_GE_OQ);
  t = _mm512_max_ps(_mm512_set1_ps(EXP2_MIN), t);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP2_FRACTION[0]);
  for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_FRACTION[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

// hd in J 16-lane chunks, the last one masked by `tail` when TAIL (hd % 16 != 0).  The
// 16 keys' lane vectors are computed into registers first (independent chains), then
// folded by the halving tree; everything stays in vector registers (no scalar exp).
template <class E, bool TAIL>
SPEL_TARGET_AVX512 inline __m512 chunk16(__mmask16 tail, bool last, const E* p) {
  if constexpr (TAIL && std::is_same<E, float>::value) {
    if (last) return _mm512_maskz_loadu_ps(tail, p);
  }
  if constexpr (std::is_same<E, float>::value)
    return _mm512_loadu_ps(p);
  else
    return load16(tail, p);
}

// A row of hd elements as J vectors of 16 floats.
template <class E, int J, bool TAIL>
SPEL_TARGET_AVX512 __attribute__((always_inline)) inline void row_chunks(__mmask16 tail, const E* p,
                                                                       __m512* out) {
#pragma GCC unroll 8
  for (int j = 0; j < J; j++) out[j] = chunk16<E, TAIL>(tail, j == J - 1, p + 16 * j);
}

// One block for NQ queries of one head (NQ = 2: two queries that see the whole block,
// sharing each key and value load; every query's operations are those of NQ = 1).
template <class E, int J, bool TAIL, int NQ>
SPEL_TARGET_AVX512 inline void block_avx512(const AttendArgs& A, __mmask16 tail, int64_t b0, int64_t nb, int64_t h,
                                            const float* const* q, float* const* m_run, float* const* lanes,
                                            float* const* acc) {
  __m512 qv[NQ][J];
#pragma GCC unroll 2
  for (int n = 0; n < NQ; n++) row_chunks<float, J, TAIL>(tail, q[n], qv[n]);
  __m512 kl[NQ][BK];   // key w's 16 lanes per query; zeros past nb (never read)
#pragma GCC unroll 16
  for (int w = 0; w < BK; w++) {
    if (w < nb) {
      __m512 kc[J];
      row_chunks<E, J, TAIL>(tail, A.key<E>(b0 + w, h), kc);
#pragma GCC unroll 2
      for (int n = 0; n < NQ; n++) {
        __m512 a = _mm512_mul_ps(qv[n][0], kc[0]);
#pragma GCC unroll 8
        for (int j = 1; j < J; j++) a = _mm512_fmadd_ps(qv[n][j], kc[j], a);
        kl[n][w] = a;
      }
    } else {
#pragma GCC unroll 2
      for (int n = 0; n < NQ; n++) kl[n][w] = _mm512_setzero_ps();
    }
  }
  const __mmask16 live = static_cast<__mmask16>(nb == BK ? 0xFFFF : (1u << nb) - 1);
  __m512 al[NQ];
  alignas(64) float p[NQ][BK];
#pragma GCC unroll 2
  for (int n = 0; n < NQ; n++) {
    const __m512* x = kl[n];
    const __m512 sums = last_pair(pair3(pair2(pair1(x[0], x[1]), pair1(x[2], x[3])),
                                        pair2(pair1(x[4], x[5]), pair1(x[6], x[7]))),
                                  pair3(pair2(pair1(x[8], x[9]), pair1(x[10], x[11])),
                                        pair2(pair1(x[12], x[13]), pair1(x[14], x[15]))));
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(sums, _mm512_set1_ps(A.c)));
    const float mx = std::max(*m_run[n], _mm512_reduce_max_ps(s));
    al[n] = exp2_nonpos16(_mm512_set1_ps(*m_run[n] - mx));   // exp2_nonpos's bits, in every lane
    *m_run[n] = mx;
    const __m512 pv = _mm512_maskz_mov_ps(live, exp2_nonpos16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
    _mm512_storeu_ps(lanes[n], _mm512_fmadd_ps(_mm512_loadu_ps(lanes[n]), al[n], pv));
    _mm512_store_ps(p[n], pv);
  }
  __m512 e[NQ][J], o[NQ][J];
#pragma GCC unroll 2
  for (int n = 0; n < NQ; n++)
#pragma GCC unroll 8
    for (int j = 0; j < J; j++) e[n][j] = o[n][j] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int w = 0; w < BK; w++) {
    if (w >= nb) break;
    __m512 vc[J];
    row_chunks<E, J, TAIL>(tail, A.value<E>(b0 + w, h), vc);
#pragma GCC unroll 2
    for (int n = 0; n < NQ; n++) {
      const __m512 pw = _mm512_set1_ps(p[n][w]);
      __m512* x = (w & 1) ? o[n] : e[n];
#pragma GCC unroll 8
      for (int j = 0; j < J; j++) x[j] = _mm512_fmadd_ps(pw, vc[j], x[j]);
    }
  }
#pragma GCC unroll 2
  for (int n = 0; n < NQ; n++)
#pragma GCC unroll 8
    for (int j = 0; j < J; j++) {
      const __mmask16 m = TAIL && j == J - 1 ? tail : static_cast<__mmask16>(0xFFFF);
      _mm512_mask_storeu_ps(acc[n] + 16 * j, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, acc[n] + 16 * j), al[n],
                                                                _mm512_add_ps(e[n][j], o[n][j])));
    }
}

// Two queries at a time where both see the whole block.
template <class E, int J, bool TAIL>
SPEL_TARGET_AVX512 void attend_avx512(const AttendArgs& A, Running& R) {
  const __mmask16 tail = static_cast<__mmask16>(A.hd % 16 ? (1u << (A.hd % 16)) - 1 : 0xFFFF);
  walk<E>(
      A, R,
      [&](int64_t b0, int64_t nb, int64_t h, const float* q, float& m_run, float* lanes, float* acc)
          SPEL_TARGET_AVX512 {
            const float* qs[1] = {q};
            float* mr[1] = {&m_run};
            float* ln[1] = {lanes};
            float* ac[1] = {acc};
            block_avx512<E, J, TAIL, 1>(A, tail, b0, nb, h, qs, mr, ln, ac);
          },
      [&](int64_t b0, int64_t h, int64_t r, int64_t r2) SPEL_TARGET_AVX512 {
        const float* qs[2] = {A.Q + r * A.hd, A.Q + r2 * A.hd};
        float* mr[2] = {&R.m[r], &R.m[r2]};
        float* ln[2] = {R.lanes.data() + r * BK, R.lanes.data() + r2 * BK};
        float* ac[2] = {R.acc.data() + r * A.hd, R.acc.data() + r2 * A.hd};
        block_avx512<E, J, TAIL, 2>(A, tail, b0, BK, h, qs, mr, ln, ac);
      });
}

// --- AVX2 + FMA (hd a multiple of 16): the 16 lanes as two 8-lane halves ----------------
// The halving tree of 8 keys' s8 vectors (lanes l + (l+8) already summed):
// + 4 (pairs of keys), + 2, + 1 (lane order 0 2 4 6 1 3 5 7), into key order.
SPEL_TARGET_AVX2_FMA inline __m256 quad_sum8(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
SPEL_TARGET_AVX2_FMA inline __m256 pair_sum8(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE));
}
SPEL_TARGET_AVX2_FMA inline __m256 last_sum8(__m256 a, __m256 b) {
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

SPEL_TARGET_AVX2_FMA inline __m256 exp2_nonpos8(__m256 t) {
  const __m256 live = _mm256_cmp_ps(t, _mm256_set1_ps(EXP2_MIN), _CMP_GE_OQ);
  t = _mm256_max_ps(_mm256_set1_ps(EXP2_MIN), t);
  const __m256 n = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(EXP2_FRACTION[0]);
  for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_FRACTION[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

SPEL_TARGET_AVX2_FMA inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
}

template <class E, int J>
SPEL_TARGET_AVX2_FMA void attend_avx2(const AttendArgs& A, Running& R) {
  walk<E>(A, R, [&](int64_t b0, int64_t nb, int64_t h, const float* q, float& m_run, float* lanes, float* acc)
                 SPEL_TARGET_AVX2_FMA {
    __m256 s8[BK];   // key w's lanes l + (l+8), computed first (independent chains); zeros past nb
#pragma GCC unroll 16
    for (int w = 0; w < BK; w++) {
      if (w < nb) {
        const E* k = A.key<E>(b0 + w, h);
        __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
        __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(q + 8), load8(k + 8));
#pragma GCC unroll 8
        for (int j = 1; j < J; j++) {
          lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * j), load8(k + 16 * j), lo);
          hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * j + 8), load8(k + 16 * j + 8), hi);
        }
        s8[w] = _mm256_add_ps(lo, hi);
      } else {
        s8[w] = _mm256_setzero_ps();
      }
    }
    auto eight = [&s8](int w) SPEL_TARGET_AVX2_FMA {
      return last_sum8(pair_sum8(quad_sum8(s8[w], s8[w + 1]), quad_sum8(s8[w + 2], s8[w + 3])),
                       pair_sum8(quad_sum8(s8[w + 4], s8[w + 5]), quad_sum8(s8[w + 6], s8[w + 7])));
    };
    const __m256 c = _mm256_set1_ps(A.c), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nb)), idx));
    const __m256 live1 =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nb) - 8), idx));
    const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(eight(0), c), live0);
    const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_mul_ps(eight(8), c), live1);
    const float mx = std::max(m_run, max8(_mm256_max_ps(s0, s1)));
    const __m256 al = exp2_nonpos8(_mm256_set1_ps(m_run - mx));   // exp2_nonpos's bits, in every lane
    m_run = mx;
    const __m256 mv = _mm256_set1_ps(mx);
    const __m256 p0 = _mm256_and_ps(live0, exp2_nonpos8(_mm256_sub_ps(s0, mv)));
    const __m256 p1 = _mm256_and_ps(live1, exp2_nonpos8(_mm256_sub_ps(s1, mv)));
    _mm256_storeu_ps(lanes, _mm256_fmadd_ps(_mm256_loadu_ps(lanes), al, p0));
    _mm256_storeu_ps(lanes + 8, _mm256_fmadd_ps(_mm256_loadu_ps(lanes + 8), al, p1));
    alignas(32) float p[BK];
    _mm256_store_ps(p, p0);
    _mm256_store_ps(p + 8, p1);
    for (int j = 0; j < 2 * J; j++) {   // 8 elements of hd at a time
      __m256 e = _mm256_setzero_ps(), o = _mm256_setzero_ps();
      for (int w = 0; w < nb; w++) {
        __m256& y = (w & 1) ? o : e;
        y = _mm256_fmadd_ps(_mm256_set1_ps(p[w]), load8(A.value<E>(b0 + w, h) + 8 * j), y);
      }
      _mm256_storeu_ps(acc + 8 * j, _mm256_fmadd_ps(_mm256_loadu_ps(acc + 8 * j), al, _mm256_add_ps(e, o)));
    }
  });
}

template <class E, int J>
bool attend_simd_for(const AttendArgs& A, Running& R) {
  constexpr bool half = std::is_same<E, uint16_t>::value;
  if (use_avx512() && (!half || A.hd % 16 == 0)) {
    if (A.hd % 16)
      attend_avx512<E, J, true>(A, R);
    else
      attend_avx512<E, J, false>(A, R);
    return true;
  }
  if (use_avx2() && HAVE_FMA && A.hd % 16 == 0 && (!half || HAVE_F16C)) {
    attend_avx2<E, J>(A, R);
    return true;
  }
  return false;
}

// hd up to 128 (8 chunks of 16); the model's 64 is 4
template <class E>
bool attend_simd(const AttendArgs& A, Running& R) {
  switch ((A.hd + 15) / 16) {
    case 1: return attend_simd_for<E, 1>(A, R);
    case 2: return attend_simd_for<E, 2>(A, R);
    case 3: return attend_simd_for<E, 3>(A, R);
    case 4: return attend_simd_for<E, 4>(A, R);
    case 5: return attend_simd_for<E, 5>(A, R);
    case 6: return attend_simd_for<E, 6>(A, R);
    case 7: return attend_simd_for<E, 7>(A, R);
    case 8: return attend_simd_for<E, 8>(A, R);
    default: return false;
  }
}
#endif

template <class E>
void attend_keys_of(const AttendArgs& A, Running& R) {
#if SPEL_AVX2
  if (!attend_simd<E>(A, R))
#endif
    attend_ref<E>(A, R);
}

void attend_keys(const AttendArgs& A, Running& R) {
  if (A.half)
    attend_keys_of<uint16_t>(A, R);
  else
    attend_keys_of<float>(A, R);
}

// R = R merged with the next chunk's state S (the canonical order above)
void merge_chunk(Running& R, const Running& S, int64_t n, int64_t hd) {
  for (int64_t r = 0; r < n; r++) {
    if (S.m[r] == -INFINITY) continue;   // the chunk is past this query's keys
    const float mx = std::max(R.m[r], S.m[r]);
    const float a = exp2_nonpos(R.m[r] - mx), b = exp2_nonpos(S.m[r] - mx);
    R.m[r] = mx;
    for (int l = 0; l < BK; l++) R.lanes[r * BK + l] = std::fma(R.lanes[r * BK + l], a, S.lanes[r * BK + l] * b);
    for (int64_t d = 0; d < hd; d++) R.acc[r * hd + d] = std::fma(R.acc[r * hd + d], a, S.acc[r * hd + d] * b);
  }
}

}  // namespace

void attend_coming(int64_t rows) {
  if (rows > CHUNK) prewake_helper();
}

void attend_rows(const AttendArgs& all, float* O) {
  static thread_local std::vector<Running> this_thread;
  std::vector<Running>& parts = this_thread;   // a name the helper's lambda can capture
  const int64_t n = all.M * all.H, keys = all.visible(all.M - 1);
  const int64_t chunks = (keys + CHUNK - 1) / CHUNK;
  if (static_cast<int64_t>(parts.size()) < chunks) parts.resize(chunks);
  auto reduce = [&](int64_t c) {
    AttendArgs A = all;
    A.k_begin = c * CHUNK;
    A.k_end = std::min(keys, A.k_begin + CHUNK);
    parts[c].reset(n, all.hd);
    attend_keys(A, parts[c]);
  };
  if (chunks > 1)
    share_items(chunks, reduce);   // a long cache: the chunks shared with the helper thread
  else
    reduce(0);
  Running& R = parts[0];
  for (int64_t c = 1; c < chunks; c++) merge_chunk(R, parts[c], n, all.hd);
  for (int64_t r = 0; r < n; r++) {
    const float l = halving_sum16(R.lanes.data() + r * BK);
    for (int64_t d = 0; d < all.hd; d++) O[r * all.hd + d] = R.acc[r * all.hd + d] / l;
  }
}

}  // namespace spel
