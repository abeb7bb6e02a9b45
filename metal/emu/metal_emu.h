// metal_emu.h -- CPU emulation of the Metal Shading Language subset that the
// spel-mlx kernels (metal/*.metal) use, so their bodies compile UNCHANGED as
// C++17 and run on Linux in tests.  tests/metal_emu/build.py wraps each body in
// the same signature MLX's mx.fast.metal_kernel generates and includes this file
// first.  Tests only: nothing here is fast, and it is not a GPU model.
//
// What is emulated, and how faithfully
// ------------------------------------
// Launch     dispatchThreads semantics as MLX uses them: grid in threads, the
//            threadgroup clamped to the grid (min per axis, like MLX), edge
//            threadgroups partial (non-uniform).  Threadgroups run ONE AT A TIME
//            in z,y,x order (a legal GPU schedule; kernels must not rely on any
//            other).  Inside a threadgroup, when the kernel uses barriers or SIMD
//            functions, every thread is either a real OS thread (default: a
//            persistent pool, worker w = thread index w of every group, truly
//            concurrent) or, with lanes="fibers", a ucontext fiber switched only
//            at barriers / SIMD functions (same semantics, deterministic, much
//            cheaper on a loaded machine; used for model-level tests).  Kernels
//            without barriers or SIMD functions run their threads one after
//            another on the caller's thread.  Max 1024 threads per threadgroup.
// Ids        thread_position_in_grid, thread_position_in_threadgroup,
//            threadgroup_position_in_grid, threads_per_threadgroup (actual size
//            of a partial edge group), threadgroups_per_grid, threads_per_grid,
//            grid_size, thread_index_in_threadgroup (x + y*ex + z*ex*ey with the
//            group's actual extents), simdgroup_index_in_threadgroup
//            (= index / 32), thread_index_in_simdgroup (= index % 32),
//            simdgroups_per_threadgroup, threads_per_simdgroup and
//            thread_execution_width (32).
// Barriers   metal::threadgroup_barrier(flags) and simdgroup_barrier(flags) are
//            real barriers over the active threads of the threadgroup / SIMD
//            group, with full memory ordering whatever the flags say (stronger
//            than Metal: a kernel missing a mem_device fence is not caught).
//            A barrier that is not reached by every thread (divergent control
//            flow, early return) is reported as an error instead of hanging:
//            with fibers at once, with OS threads after METAL_EMU_TIMEOUT_S
//            seconds (default 30).  Metal calls that undefined behaviour.
// SIMD       simd_sum, simd_max, simd_min, simd_shuffle, simd_broadcast,
//            simd_shuffle_xor, simd_shuffle_down, simd_shuffle_up over 32-lane
//            groups (a partial last group has fewer lanes).  Every lane of the
//            group must call the same sequence of SIMD functions (uniform
//            control flow); the emulation enforces it with a barrier per call.
//            Reductions are a butterfly (offsets 16, 8, 4, 2, 1), so every lane
//            gets the same, order-fixed result; Apple's hardware order is not
//            documented, so sums may differ from the GPU in the last bits, but
//            never between lanes or between calls.  Shuffles from an inactive
//            lane return the caller's own value.
// Memory     `device`, `constant`, `thread` are empty macros; `threadgroup` is
//            `static`: a threadgroup array is one object shared by the threads
//            of the running threadgroup (correct because groups run one at a
//            time).  Unlike Metal, it is zero before the first group and keeps
//            the previous group's values afterwards, so read-before-write bugs
//            in threadgroup memory are NOT caught.  Use `threadgroup` only to
//            declare arrays in a kernel body, never as a pointer qualifier.
//            Outputs are pre-filled with NaN / 0xA5 bytes by build.py, so an
//            output element a kernel forgets to write is caught.
// Math       metal::{exp, exp2, log, sqrt, rsqrt, sin, cos, pow, fabs, abs, rint,
//            round, floor, ceil, fma, min, max, fmin, fmax, clamp, select},
//            metal::precise::{divide, sqrt, exp, rsqrt} and metal::fast::{exp,
//            divide, rsqrt} map to the correctly rounded (or libm) C++
//            functions.  The GPU's fast:: variants and its default math are
//            less accurate (a few ulp); tests compare with tolerances, and exact
//            equality is only asserted where a kernel is exact by construction
//            (integer sums, max, correctly rounded precise::divide + rint).
//            FMA contraction is off here (-ffp-contract=off); the Metal compiler
//            may contract a*b+c, another last-bit difference.
// Types      uint, uchar, ushort, uint3 (.x .y .z), int8_t ... uint64_t,
//            as_type<T>(x) (bit cast), INFINITY.  No vector types (half, float4,
//            ...): the kernels use scalar loads.
// Not emulated: atomics, textures, simdgroup matrices, quadgroups, half /
//            bfloat, function constants, indirect dispatch.  Using one fails to
//            compile, which is the point: kernels stay inside what is tested.
#pragma once

#include "runtime.h"   // the threadgroups, simdgroups, barriers and pool the built-ins use

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags) {
  metal_emu::ThreadCtx& c = metal_emu::ctx_for("threadgroup_barrier");
  if (c.fibers)
    c.fibers->barrier(c.fibers->tg, c.tg_threads, "threadgroup_barrier");
  else
    c.tg_bar->wait(c.tg_threads);
}
inline void simdgroup_barrier(mem_flags) {
  metal_emu::ThreadCtx& c = metal_emu::ctx_for("simdgroup_barrier");
  if (c.fibers)
    c.fibers->barrier(c.fibers->sgs[c.fiber_index / 32], c.sg_lanes, "simdgroup_barrier");
  else
    c.sg->bar.wait(c.sg_lanes);
}

template <typename T> inline T simd_sum(T x) {
  return metal_emu::simd_reduce(x, T(0), [](T a, T b) { return a + b; });
}
template <typename T> inline T simd_max(T x) {
  return metal_emu::simd_reduce(x, std::numeric_limits<T>::lowest(),
                                [](T a, T b) { return a > b ? a : b; });
}
template <typename T> inline T simd_min(T x) {
  return metal_emu::simd_reduce(x, std::numeric_limits<T>::max(),
                                [](T a, T b) { return a < b ? a : b; });
}
template <typename T> inline T simd_shuffle(T x, ushort lane) { return metal_emu::simd_pick(x, lane); }
template <typename T> inline T simd_broadcast(T x, ushort lane) { return metal_emu::simd_pick(x, lane); }
template <typename T> inline T simd_shuffle_xor(T x, ushort mask) {
  return metal_emu::simd_pick(x, (long)(metal_emu::my_lane() ^ mask));
}
template <typename T> inline T simd_shuffle_down(T x, ushort delta) {
  return metal_emu::simd_pick(x, (long)metal_emu::my_lane() + delta);
}
template <typename T> inline T simd_shuffle_up(T x, ushort delta) {
  return metal_emu::simd_pick(x, (long)metal_emu::my_lane() - (long)delta);
}

using std::ceil;
using std::cos;
using std::exp;
using std::exp2;
using std::fabs;
using std::floor;
using std::fma;
using std::fmax;
using std::fmin;
using std::log;
using std::numeric_limits;
using std::pow;
using std::rint;
using std::round;
using std::sin;
using std::sqrt;
inline float abs(float x) { return std::fabs(x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }
template <typename T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <typename To, typename From> inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}

namespace precise {
inline float divide(float a, float b) { return a / b; }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float exp(float x) { return std::exp(x); }
}  // namespace precise
namespace fast {
inline float divide(float a, float b) { return a / b; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float exp(float x) { return std::exp(x); }
}  // namespace fast

}  // namespace metal

using metal::as_type;

// Address-space qualifiers last, so the standard headers above are unaffected.
// (After this point `thread` is a keyword-like macro: the generated wrapper only
// calls metal_emu::dispatch and never names std::thread.)
#define device
#define constant
#define thread
#define threadgroup static
