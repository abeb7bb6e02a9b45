// linear: x @ W^T from the contiguous row blocks [nb, in, rb] of model.Linear, one node
// writing the [M, out] result in place (no broadcast of x, no reshape or transposed
// copy).  The product is the AVX-512 tiles where the CPU has them, else one BLAS sgemm
// per block (as MLX's batched matmul makes).  The blocks hold float32, or binary16 where
// every weight of the matrix is exactly a binary16 value (model.Linear checks): each is
// widened exactly as it is read, so both give the same bits, and the tiles read half the
// bytes (a pass's weights then stay in the L3 cache, or stream in half the time).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.h"
#include "kernels.h"
#include "ops.h"

// The BLAS MLX itself calls: resolved at load time through the global scope
// first, where spel_mlx._blas put OpenBLAS (else MLX's bundled reference BLAS).
extern "C" void cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111 };

namespace spel {
namespace {

std::atomic<int> linear_mode{0};   // 0 auto, 1 the fmaf reference (tests), 2 OpenBLAS
std::atomic<bool> linear_share{false};   // the tiles' blocks shared with the helper thread
// fewer multiply-adds than this: one thread (waking the helper would cost more)
constexpr int64_t SHARE_MIN_MACS = 1 << 17;

// Row blocks [nb, K, rb] of float32 or binary16 weights.
struct Blocks {
  const void* p;
  int64_t nb, K, rb;
  bool half;
  explicit Blocks(const mx::array& b)
      : p(b.data<void>()), nb(b.shape(0)), K(b.shape(1)), rb(b.shape(2)), half(b.dtype() == mx::float16) {}
};

inline float weight_at(const float* W, int64_t i) { return W[i]; }
inline float weight_at(const uint16_t* W, int64_t i) { return half_to_float(W[i]); }

// The products of linear_avx512, one fmaf chain per element (its reference).
template <class E>
void linear_fma_ref(const float* X, int64_t M, int64_t K, const E* Wb, int64_t nb, int64_t rb, float* Y) {
  for (int64_t b = 0; b < nb; b++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t c = 0; c < rb; c++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc = std::fma(X[m * K + k], weight_at(Wb, (b * K + k) * rb + c), acc);
        Y[m * nb * rb + b * rb + c] = acc;
      }
}

// The small-M product of the sub-blocks on AVX-512 machines: MR (<= 6) rows times
// 16*NC (<= 64) columns of one contiguous row block, every accumulator in a
// register, each weight read once in address order.  Each output element is one
// fused-multiply-add chain over k in order, so a row's result does not depend on
// M or on the tiling (fast K+1 rows equal single-token rows, bit for bit).
#if SPEL_AVX2
SPEL_TARGET_AVX512 inline __m512 load16(const float* W) { return _mm512_loadu_ps(W); }
SPEL_TARGET_AVX512 inline __m512 load16(const uint16_t* W) {   // binary16 widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(W)));
}

template <int MR, int NC, class E>
SPEL_TARGET_AVX512 void tile_avx512(const float* X, int64_t K, const E* W, int64_t rb, float* Y, int64_t ldy) {
  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m512 w[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) w[c] = load16(W + k * rb + 16 * c);
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
      const __m512 xb = _mm512_set1_ps(X[m * K + k]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; c++) acc[m][c] = _mm512_fmadd_ps(xb, w[c], acc[m][c]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(Y + m * ldy + 16 * c, acc[m][c]);
}

template <int MR, class E>
SPEL_TARGET_AVX512 void tile_avx512_cols(int nc, const float* X, int64_t K, const E* W, int64_t rb, float* Y,
                                         int64_t ldy) {
  switch (nc) {
    case 4: tile_avx512<MR, 4>(X, K, W, rb, Y, ldy); break;
    case 3: tile_avx512<MR, 3>(X, K, W, rb, Y, ldy); break;
    case 2: tile_avx512<MR, 2>(X, K, W, rb, Y, ldy); break;
    default: tile_avx512<MR, 1>(X, K, W, rb, Y, ldy); break;
  }
}

template <class E>
SPEL_TARGET_AVX512 void linear_avx512(const float* X, int64_t M, int64_t K, const E* Wb, int64_t nb, int64_t rb,
                                      float* Y, int64_t ldy) {
  for (int64_t b = 0; b < nb; b++) {
    const E* W = Wb + b * K * rb;
    for (int64_t c0 = 0; c0 < rb; c0 += 64) {
      const int nc = static_cast<int>(std::min<int64_t>(4, (rb - c0) / 16));
      for (int64_t r0 = 0; r0 < M; r0 += 6) {
        const float* x = X + r0 * K;
        float* y = Y + r0 * ldy + b * rb + c0;
        switch (std::min<int64_t>(6, M - r0)) {
          case 6: tile_avx512_cols<6>(nc, x, K, W + c0, rb, y, ldy); break;
          case 5: tile_avx512_cols<5>(nc, x, K, W + c0, rb, y, ldy); break;
          case 4: tile_avx512_cols<4>(nc, x, K, W + c0, rb, y, ldy); break;
          case 3: tile_avx512_cols<3>(nc, x, K, W + c0, rb, y, ldy); break;
          case 2: tile_avx512_cols<2>(nc, x, K, W + c0, rb, y, ldy); break;
          default: tile_avx512_cols<1>(nc, x, K, W + c0, rb, y, ldy); break;
        }
      }
    }
  }
}
#endif

// The same products on AVX2 machines (8-wide registers, FMA, F16C): MR (<= 6) rows
// times 8*NC columns, NC chosen so the accumulators and weights fit the 16 registers.
// The same per-element FMA chains as the AVX-512 tiles: the same bits.
#if SPEL_AVX2
#define SPEL_TARGET_AVX2_FMA __attribute__((target("avx2,fma,f16c")))
SPEL_TARGET_AVX2_FMA inline __m256 load8(const float* W) { return _mm256_loadu_ps(W); }
SPEL_TARGET_AVX2_FMA inline __m256 load8(const uint16_t* W) {   // binary16 widened exactly
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W)));
}

template <int MR, int NC, class E>
SPEL_TARGET_AVX2_FMA void tile_avx2(const float* X, int64_t K, const E* W, int64_t rb, float* Y, int64_t ldy) {
  __m256 acc[MR][NC];
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) acc[m][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m256 w[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) w[c] = load8(W + k * rb + 8 * c);
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
      const __m256 xb = _mm256_broadcast_ss(X + m * K + k);
#pragma GCC unroll 4
      for (int c = 0; c < NC; c++) acc[m][c] = _mm256_fmadd_ps(xb, w[c], acc[m][c]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) _mm256_storeu_ps(Y + m * ldy + 8 * c, acc[m][c]);
}

// columns [c0, rb) of one row block for rows r0 .. r0+MR, in tiles of 8*NC then 8
template <int MR, int NC, class E>
SPEL_TARGET_AVX2_FMA void cols_avx2(const float* x, int64_t K, const E* W, int64_t rb, float* y, int64_t ldy) {
  int64_t c0 = 0;
  for (; c0 + 8 * NC <= rb; c0 += 8 * NC) tile_avx2<MR, NC>(x, K, W + c0, rb, y + c0, ldy);
  for (; c0 < rb; c0 += 8) tile_avx2<MR, 1>(x, K, W + c0, rb, y + c0, ldy);
}

template <class E>
SPEL_TARGET_AVX2_FMA void linear_avx2(const float* X, int64_t M, int64_t K, const E* Wb, int64_t nb, int64_t rb,
                                      float* Y, int64_t ldy) {
  for (int64_t b = 0; b < nb; b++) {
    const E* W = Wb + b * K * rb;
    for (int64_t r0 = 0; r0 < M; r0 += 6) {
      const float* x = X + r0 * K;
      float* y = Y + r0 * ldy + b * rb;
      switch (std::min<int64_t>(6, M - r0)) {
        case 6: cols_avx2<6, 2>(x, K, W, rb, y, ldy); break;
        case 5: cols_avx2<5, 2>(x, K, W, rb, y, ldy); break;
        case 4: cols_avx2<4, 3>(x, K, W, rb, y, ldy); break;
        case 3: cols_avx2<3, 3>(x, K, W, rb, y, ldy); break;
        case 2: cols_avx2<2, 4>(x, K, W, rb, y, ldy); break;
        default: cols_avx2<1, 4>(x, K, W, rb, y, ldy); break;
      }
    }
  }
}

const bool HAVE_FMA_F16C = __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif

// the FMA-chain tiles this CPU runs: 2 AVX-512, 1 AVX2 (with FMA and F16C), 0 none
inline int tiles() {
#if SPEL_AVX2
  if (use_avx512()) return 2;
  if (use_avx2() && HAVE_FMA_F16C) return 1;
#endif
  return 0;
}

// Y [M, nb*rb] = X [M, d_in] (contiguous) times the row blocks: the AVX-512 or AVX2
// tiles when the CPU has them (blocks of whole 16-column vectors), else one BLAS sgemm
// per block (binary16 blocks widened into a float32 copy first).
template <class E>
void linear_typed(const float* X, int64_t M, const E* Wb, const Blocks& B, float* Y) {
  const int64_t d_in = B.K, nb = B.nb, rb = B.rb;
  const int mode = linear_mode.load(std::memory_order_relaxed);
  if (mode == 1) {
    linear_fma_ref(X, M, d_in, Wb, nb, rb, Y);
    return;
  }
#if SPEL_AVX2
  const int t = mode == 0 && rb % 16 == 0 ? tiles() : 0;
  if (t > 0) {
    // a block's columns are one tile's whatever thread runs it: the same bits shared or not
    auto block = [&](int64_t b) {
      if (t == 2)
        linear_avx512(X, M, d_in, Wb + b * d_in * rb, 1, rb, Y + b * rb, nb * rb);
      else
        linear_avx2(X, M, d_in, Wb + b * d_in * rb, 1, rb, Y + b * rb, nb * rb);
    };
    if (nb >= 2 && M * d_in * rb * nb >= SHARE_MIN_MACS && linear_share.load(std::memory_order_relaxed)) {
      share_items(nb, block);
    } else {
      for (int64_t b = 0; b < nb; b++) block(b);
    }
    return;
  }
#endif
  std::vector<float> wide;
  for (int64_t b = 0; b < nb; b++) {
    const float* W;
    if constexpr (std::is_same_v<E, float>) {
      W = Wb + b * d_in * rb;
    } else {
      wide.resize(d_in * rb);
      for (int64_t i = 0; i < d_in * rb; i++) wide[i] = weight_at(Wb, b * d_in * rb + i);
      W = wide.data();
    }
    cblas_sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, M, rb, d_in, 1.0f, X, d_in, W, rb, 0.0f,
                Y + b * rb, nb * rb);
  }
}

inline void linear_body(const float* X, int64_t M, const Blocks& B, float* Y) {
  if (B.half)
    linear_typed(X, M, static_cast<const uint16_t*>(B.p), B, Y);
  else
    linear_typed(X, M, static_cast<const float*>(B.p), B, Y);
}

class SpelLinear : public CpuPrimitive {
 public:
  explicit SpelLinear(mx::Stream s) : CpuPrimitive(s, P_LINEAR) {}
  const char* name() const override { return "SpelLinear"; }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> xc;
      linear_body(contiguous_2d(in[0], xc), in[0].shape(0), Blocks(in[1]), out[0].data<float>());
    };
  }
};

}  // namespace

void linear_into(const float* X, int64_t M, const mx::array& blocks, float* Y) {
  ProfScope prof(P_IN_LINEAR);   // the sub-blocks' products, inside their own time
  linear_body(X, M, Blocks(blocks), Y);
}

mx::array linear(const mx::array& x, const mx::array& blocks) {
  check_f32(x, "linear", "x", 2);
  check_blocks(blocks, "linear", "weight", x.shape(1));
  return mx::array({x.shape(0), blocks.shape(0) * blocks.shape(2)}, mx::float32,
                   std::make_shared<SpelLinear>(cpu_stream()), {x, blocks});
}

// Which product `linear` and the sub-blocks use: "auto" (AVX-512 tiles where the CPU
// has them, else BLAS), "reference" (fmaf chains, what the tiles equal) or "blas".
std::string set_linear(const std::string& mode) {
  static const char* names[3] = {"auto", "reference", "blas"};
  for (int i = 0; i < 3; i++)
    if (mode == names[i]) return names[linear_mode.exchange(i)];
  throw std::invalid_argument("set_linear: expected auto, reference or blas, not " + mode);
}

// Share the tiles' row blocks with the helper thread (the same bits); returns the old setting.
bool set_linear_share(bool enable) { return linear_share.exchange(enable); }

// True when linear_body computes every output element as one FMA chain over k in
// order (the AVX-512 or AVX2 tiles, or their reference) for blocks of whole 16-column
// vectors: a row's product then does not depend on how many rows the call has.
bool fma_chain_linear() {
  const int mode = linear_mode.load();
  return mode == 1 || (mode == 0 && tiles() > 0);
}

}  // namespace spel
