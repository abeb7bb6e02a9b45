// What the machine can do, for bench/: the time one thread takes to read an array
// (the read bandwidth a single-token step is bound by when its weights stream from DRAM).
#include <chrono>
#include <stdexcept>

#include "common.h"
#include "ops.h"

namespace spel {
namespace {

// the sum of every float in 32 independent partial sums (four 8-wide add chains, so
// the adds keep up with the loads; every cache line is loaded)
float read_all(const float* p, int64_t n) {
  float acc[32] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 32; l++) acc[l] += p[i + l];
  for (; i < n; i++) acc[0] += p[i];
  float s = 0.0f;
  for (int l = 0; l < 32; l++) s += acc[l];
  return s;
}

#if SPEL_AVX2
SPEL_TARGET_AVX2 float read_all_avx2(const float* p, int64_t n) { return read_all(p, n); }
#endif

}  // namespace

std::pair<double, float> read_seconds(const mx::array& a) {
  if (a.dtype() != mx::float32 || !a.flags().row_contiguous || !a.is_available())
    throw std::invalid_argument("read_seconds: expected an evaluated row-contiguous float32 array");
  const auto t0 = std::chrono::steady_clock::now();
#if SPEL_AVX2
  const float s = use_avx2() ? read_all_avx2(a.data<float>(), a.size()) : read_all(a.data<float>(), a.size());
#else
  const float s = read_all(a.data<float>(), a.size());
#endif
  const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  return {dt.count(), s};
}

}  // namespace spel
