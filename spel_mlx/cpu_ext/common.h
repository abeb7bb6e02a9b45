// Fused CPU primitives for the MLX target (spel_mlx._spel_cpu): the base every
// primitive derives from and the helpers all families share.
//
// On the CPU each MLX graph node costs microseconds of dispatch whatever its size,
// so each primitive here is one node where MLXOps (spel_mlx/model/ops.py) spends many.
// float32 only; inputs may be strided views (read through their strides).  Each
// primitive runs on the CPU stream's worker thread like MLX's own CPU ops.  Every
// SIMD kernel sits beside its scalar reference and gives the same bits; MLXOps and
// the float64 numpy reference check them (tests/test_cpu_ops.py).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;

// x86-64 SIMD variants are built with per-function target attributes and chosen at
// load time from the CPU's features.  They do exactly the float operations of their
// scalar references in the same order (separate multiply and add: -ffp-contract=off),
// so both give identical bits.  -DSPEL_NO_SIMD builds only the portable code.
#if defined(__x86_64__) && !defined(SPEL_NO_SIMD) && (defined(__GNUC__) || defined(__clang__))
#define SPEL_AVX2 1
#define SPEL_TARGET_AVX2 __attribute__((target("avx2")))
#define SPEL_TARGET_AVX512 __attribute__((target("avx512f")))
#else
#define SPEL_AVX2 0
#endif

namespace spel {

extern const bool HAVE_AVX2, HAVE_AVX512;
// the widest variant allowed: 2 AVX-512, 1 AVX2, 0 the scalar references (tests:
// set_simd(False), set_simd_level("avx2") on an AVX-512 machine)
extern std::atomic<int> simd_allowed;
inline bool use_avx2() { return HAVE_AVX2 && simd_allowed.load(std::memory_order_relaxed) >= 1; }
inline bool use_avx512() { return HAVE_AVX512 && simd_allowed.load(std::memory_order_relaxed) >= 2; }

// What profile(True) times: the worker-thread bodies, per kind of primitive, and three
// parts of the sub-blocks' own time ("block.linear", "block.attend", "block.delta").
enum ProfKind { P_LINEAR, P_CONV, P_DELTA, P_ATTEND, P_ROWWISE, P_BLOCK, P_IN_LINEAR, P_IN_ATTEND, P_IN_DELTA,
                P_KINDS };
class ProfScope {
 public:
  explicit ProfScope(ProfKind kind);
  ~ProfScope();

 private:
  ProfKind kind_;
  bool on_;
  int64_t t0_ = 0;
};

// Element (i, j, k) of a 1- to 3-D array through its strides (in elements).
struct View {
  const float* p;
  int64_t s[3] = {0, 0, 0};
  View(const mx::array& a) : p(a.data<float>()) {
    for (size_t i = 0; i < a.ndim() && i < 3; i++) s[i] = a.strides()[i];
  }
  View(const float* ptr, int64_t s0, int64_t s1 = 0, int64_t s2 = 0) : p(ptr), s{s0, s1, s2} {}
  float at(int64_t i, int64_t j = 0, int64_t k = 0) const { return p[i * s[0] + j * s[1] + k * s[2]]; }
};

// The body a primitive runs on the worker.  It captures its parameters by value (the
// primitive may be gone when the worker runs it) and gets weak copies of the arrays.
using Task = std::function<void(const std::vector<mx::array>& in, std::vector<mx::array>& out)>;

// Base of the module's primitives (CPU only): eval_cpu allocates the outputs,
// registers every array with the CPU stream's encoder and runs task() on the
// stream's worker thread, as MLX's own CPU ops do.
class CpuPrimitive : public mx::Primitive {
 public:
  CpuPrimitive(mx::Stream s, ProfKind prof) : mx::Primitive(s), prof_(prof) {}
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override;

 protected:
  virtual Task task() const = 0;

 private:
  ProfKind prof_;
};

// A primitive with parameters beside its inputs (a variant, an epsilon):
// mx.compile merges two nodes of one type with the same inputs only when these agree.
class ParamPrimitive : public CpuPrimitive {
 public:
  ParamPrimitive(mx::Stream s, ProfKind prof, int kind, float eps = 0.0f)
      : CpuPrimitive(s, prof), kind_(kind), eps_(eps) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const ParamPrimitive&>(other);
    return kind_ == o.kind_ && eps_ == o.eps_;
  }

 protected:
  const int kind_;
  const float eps_;
};

mx::Stream cpu_stream();

// helper.cpp: fn(i) for each i in [0, n) (independent items), shared with a helper
// thread when the machine has two cores and it is allowed; prewake_helper: a
// share_items call comes soon (the helper waits for it awake)
void share_items(int64_t n, const std::function<void(int64_t)>& fn);
void prewake_helper();

// Argument checks of the ops: a clear ValueError naming the op and the argument.
void check_f32(const mx::array& a, const char* op, const char* what, int ndim);
// weight blocks [nb, d_in, rb], float32 or float16 (exact binary16 weights), contiguous
void check_blocks(const mx::array& b, const char* op, const char* what, int64_t d_in);

// a 2-D array's rows as one contiguous [R, C] block, a 1-D array as a contiguous
// vector (a copy into buf when strided)
const float* contiguous_2d(const mx::array& a, std::vector<float>& buf);
const float* contiguous_1d(const mx::array& a, std::vector<float>& buf);

// Dot product with 8 independent partial sums: the compiler keeps them in one
// vector register (a single running sum is a serial dependency chain and
// cannot be vectorized without reassociating float adds).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

}  // namespace spel
