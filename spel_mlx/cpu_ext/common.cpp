// The primitive base, the argument checks, and the module's switches: which SIMD
// variant runs, and the per-kind timing of the bodies.
#include "common.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/types/half_types.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace spel {

#if SPEL_AVX2
const bool HAVE_AVX2 = __builtin_cpu_supports("avx2");
const bool HAVE_AVX512 = __builtin_cpu_supports("avx512f");
#else
const bool HAVE_AVX2 = false;
const bool HAVE_AVX512 = false;
#endif
std::atomic<int> simd_allowed{2};

namespace {

const char* const PROF_NAMES[P_KINDS] = {"linear", "conv", "delta", "attend", "rowwise", "block",
                                         "block.linear", "block.attend", "block.delta"};
std::atomic<bool> prof_on{false};
std::atomic<int64_t> prof_ns[P_KINDS], prof_calls[P_KINDS];

void alloc(mx::array& out) { out.set_data(mx::allocator::malloc(out.nbytes())); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

ProfScope::ProfScope(ProfKind kind) : kind_(kind), on_(prof_on.load(std::memory_order_relaxed)) {
  if (on_) t0_ = now_ns();
}

ProfScope::~ProfScope() {
  if (!on_) return;
  prof_ns[kind_] += now_ns() - t0_;
  prof_calls[kind_] += 1;
}

void CpuPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + ": CPU only");
}

void CpuPrimitive::eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  for (auto& o : out) alloc(o);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : in) enc.set_input_array(a);
  for (auto& o : out) enc.set_output_array(o);
  std::vector<mx::array> ins, outs;
  for (auto& a : in) ins.push_back(mx::array::unsafe_weak_copy(a));
  for (auto& o : out) outs.push_back(mx::array::unsafe_weak_copy(o));
  enc.dispatch([f = task(), kind = prof_, ins = std::move(ins), outs = std::move(outs)]() mutable {
    ProfScope prof(kind);
    f(ins, outs);
  });
}

// MLX's CPU buffers start 8 bytes past a 16-byte boundary (the allocator's size
// header), so the 256-byte rows of a weight block straddle cache lines on every other
// vector load; these arrays start on a cache line.  `huge`: the 2 MB pages inside the
// buffer are advised huge before anything touches them, so the first writes map them
// that way (no later collapse copies them).  Every caller writes the whole array, so a
// large one has its pages mapped in one call first (MADV_POPULATE_WRITE, Linux 5.14):
// faulting them in one by one costs several times that, most of all in a virtual machine
// and on 2 MB pages (docs/never_slower.md).
static mx::array aligned_array(const mx::Shape& shape, mx::Dtype dtype, bool huge) {
  constexpr uintptr_t LINE = 64;
  size_t nbytes = dtype.size();
  for (auto n : shape) nbytes *= static_cast<size_t>(n);
  auto d = mx::allocator::malloc(nbytes + LINE);
  const auto raw = reinterpret_cast<uintptr_t>(d.buffer().raw_ptr());
  const int64_t off = static_cast<int64_t>((LINE - (raw & (LINE - 1))) & (LINE - 1));
#ifdef __linux__
  constexpr uintptr_t HUGE = uintptr_t(2) << 20;
  const uintptr_t lo = (raw + HUGE - 1) & ~(HUGE - 1), hi = (raw + nbytes + LINE) & ~(HUGE - 1);
  if (huge && hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  constexpr uintptr_t PAGE = 4096, POPULATE_MIN = uintptr_t(1) << 20;
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  const uintptr_t first = (raw + PAGE - 1) & ~(PAGE - 1), last = (raw + nbytes + LINE) & ~(PAGE - 1);
  if (nbytes >= POPULATE_MIN && last > first)   // an older kernel refuses the advice: faults, as before
    madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_WRITE);
#else
  (void)huge;
#endif
  mx::Strides strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; i--) strides[i] = strides[i + 1] * shape[i + 1];
  mx::array out(shape, dtype, nullptr, {});
  const auto dims = std::count_if(shape.begin(), shape.end(), [](int n) { return n > 1; });
  mx::array::Flags flags{true, true, dims <= 1};
  out.set_data(std::move(d), nbytes / dtype.size(), strides, flags, off);
  return out;
}

mx::array aligned_copy(const mx::array& a) {
  if (!a.is_available() || !a.flags().row_contiguous)
    throw std::invalid_argument("aligned_copy: expected an evaluated row-contiguous array");
  mx::array out = aligned_array(a.shape(), a.dtype(), false);
  std::memcpy(out.data<char>(), a.data<char>(), a.nbytes());
  out.set_status(mx::array::Status::available);
  return out;
}

// Whether every float32 in [p, p + n) is finite (exponent bits not all set).
static bool all_finite(const float* p, size_t n) {
  uint32_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    std::memcpy(&u, p + i, sizeof u);
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

std::pair<mx::array, bool> read_f32(const std::string& path, int64_t offset, const std::vector<int64_t>& dims,
                                    int64_t dev, int64_t ino, bool huge) {
  const std::string where = path + " at offset " + std::to_string(offset);
  size_t nbytes = sizeof(float);
  for (auto n : dims) {
    if (n < 0 || n > INT32_MAX) throw std::invalid_argument("read_f32: dimension " + std::to_string(n) + " out of range");
    nbytes *= static_cast<size_t>(n);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("read_f32: " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<int64_t>(st.st_dev) != dev || static_cast<int64_t>(st.st_ino) != ino ||
      offset < 0 || static_cast<uint64_t>(offset) + nbytes > static_cast<uint64_t>(st.st_size)) {
    ::close(fd);
    throw std::runtime_error("read_f32: " + where + ": not the file that was mapped, or too short");
  }
  mx::array out = aligned_array(mx::Shape(dims.begin(), dims.end()), mx::float32, huge);
  char* dst = out.data<char>();
  // in pieces of 1 MB, each checked for non-finite values while it is in the cache
  constexpr size_t PIECE = size_t(1) << 20;
  size_t done = 0, checked = 0;
  bool finite = true;
  while (done < nbytes) {
    const ssize_t n = ::pread(fd, dst + done, std::min(PIECE, nbytes - done), offset + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      throw std::runtime_error("read_f32: " + where + ": " + (err ? std::strerror(err) : "unexpected end of file"));
    }
    done += static_cast<size_t>(n);
    const size_t whole = done / sizeof(float) * sizeof(float);
    finite = all_finite(reinterpret_cast<const float*>(dst + checked), (whole - checked) / sizeof(float)) && finite;
    checked = whole;
  }
  ::close(fd);
  out.set_status(mx::array::Status::available);
  return {out, finite};
}

// Whether the float32 with bits u survives a round trip through binary16 unchanged (what
// MLX's astype(float16).astype(float32) == w answers): zeros, infinities, normal halves,
// and the binary16 subnormals (multiples of 2^-24); never a NaN.
static inline bool half_exact(uint32_t u) {
  const uint32_t e = (u >> 23) & 0xffu, man = u & 0x7fffffu;
  if (e == 0xffu) return man == 0;                 // infinity yes, NaN no
  if (e == 0) return man == 0;                     // float32 subnormals are below binary16's
  const int ue = static_cast<int>(e) - 127;
  if (ue > 15 || ue < -24) return false;
  const int low = ue >= -14 ? 13 : -(ue + 1);      // mantissa bits binary16 cannot hold
  return (man & ((1u << low) - 1u)) == 0;
}

bool exactly_half(const mx::array& w) {
  if (!w.is_available() || !w.flags().row_contiguous || w.dtype() != mx::float32)
    throw std::invalid_argument("exactly_half: expected an evaluated row-contiguous float32 array");
  const float* p = w.data<float>();
  const size_t n = w.size();
  // in pieces, so a float32 checkpoint answers at its first value
  constexpr size_t PIECE = 4096;
  for (size_t i = 0; i < n; i += PIECE) {
    bool ok = true;
    for (size_t j = i, end = std::min(n, i + PIECE); j < end; j++) {
      uint32_t u;
      std::memcpy(&u, p + j, sizeof u);
      ok &= half_exact(u);
    }
    if (!ok) return false;
  }
  return true;
}

// One pass from W [R, C] to its [R/rb, C, rb] blocks (block b is rows b*rb.. transposed),
// in tiles of 16 columns so each row's reads stay in a cache line.  The scalar reference.
template <typename T>
static void transpose_blocks(const float* W, T* out, int64_t R, int64_t C, int64_t rb) {
  constexpr int64_t TC = 16;
  for (int64_t b = 0; b < R / rb; b++) {
    T* ob = out + b * C * rb;
    const float* wb = W + b * rb * C;
    for (int64_t c0 = 0; c0 < C; c0 += TC) {
      const int64_t c1 = std::min(C, c0 + TC);
      for (int64_t r = 0; r < rb; r++) {
        const float* wr = wb + r * C;
        for (int64_t c = c0; c < c1; c++) ob[c * rb + r] = static_cast<T>(wr[c]);
      }
    }
  }
}

#if SPEL_AVX2
// The same in 8 x 8 tiles transposed in registers (rb and C multiples of 8); to float16
// with F16C's round-to-nearest-even, as the scalar conversion.
template <bool HALF>
SPEL_TARGET_AVX2 __attribute__((target("f16c"))) static void transpose_blocks_avx2(
    const float* W, void* out, int64_t R, int64_t C, int64_t rb) {
  for (int64_t b = 0; b < R / rb; b++) {
    const float* wb = W + b * rb * C;
    for (int64_t c = 0; c < C; c += 8)
      for (int64_t r = 0; r < rb; r += 8) {
        __m256 x[8], t[8];
        for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_ps(wb + (r + i) * C + c);
        for (int i = 0; i < 8; i += 2) {
          t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
          t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
          x[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
          x[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
          x[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
          x[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        // x[0..3]: columns c..c+3 of rows r..r+3 (low lanes) and r+4.. from x[4..7]
        for (int i = 0; i < 4; i++) {
          t[i] = _mm256_permute2f128_ps(x[i], x[i + 4], 0x20);
          t[i + 4] = _mm256_permute2f128_ps(x[i], x[i + 4], 0x31);
        }
        const int64_t base = b * C * rb + r;
        for (int j = 0; j < 8; j++) {
          const int64_t o = base + (c + j) * rb;
          if constexpr (HALF)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + o),
                             _mm256_cvtps_ph(t[j], _MM_FROUND_TO_NEAREST_INT));
          else
            _mm256_storeu_ps(static_cast<float*>(out) + o, t[j]);
        }
      }
  }
}
#endif

mx::array weight_blocks(const mx::array& w, int64_t rb, bool half, bool huge) {
  if (!w.is_available() || !w.flags().row_contiguous || w.dtype() != mx::float32 || w.ndim() != 2)
    throw std::invalid_argument("weight_blocks: expected an evaluated row-contiguous float32 [rows, cols] array");
  const int64_t R = w.shape(0), C = w.shape(1);
  if (rb <= 0 || R % rb != 0)
    throw std::invalid_argument("weight_blocks: rb=" + std::to_string(rb) + " must divide the " +
                                std::to_string(R) + " rows");
  mx::array out = aligned_array({static_cast<int>(R / rb), static_cast<int>(C), static_cast<int>(rb)},
                                half ? mx::float16 : mx::float32, huge);
#if SPEL_AVX2
  static const bool f16c = __builtin_cpu_supports("f16c");
  if (use_avx2() && f16c && rb % 8 == 0 && C % 8 == 0) {
    if (half)
      transpose_blocks_avx2<true>(w.data<float>(), out.data<mx::float16_t>(), R, C, rb);
    else
      transpose_blocks_avx2<false>(w.data<float>(), out.data<float>(), R, C, rb);
    out.set_status(mx::array::Status::available);
    return out;
  }
#endif
  if (half)
    transpose_blocks(w.data<float>(), out.data<mx::float16_t>(), R, C, rb);
  else
    transpose_blocks(w.data<float>(), out.data<float>(), R, C, rb);
  out.set_status(mx::array::Status::available);
  return out;
}

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

void check_f32(const mx::array& a, const char* op, const char* what, int ndim) {
  if (a.dtype() != mx::float32)
    throw std::invalid_argument(std::string(op) + ": " + what + " must be float32");
  if (static_cast<int>(a.ndim()) != ndim)
    throw std::invalid_argument(std::string(op) + ": " + what + " must have " +
                                std::to_string(ndim) + " dimensions");
}

void check_blocks(const mx::array& b, const char* op, const char* what, int64_t d_in) {
  if (b.dtype() != mx::float32 && b.dtype() != mx::float16)
    throw std::invalid_argument(std::string(op) + ": " + what + " blocks must be float32 or float16");
  if (b.ndim() != 3)
    throw std::invalid_argument(std::string(op) + ": " + what + " blocks must have 3 dimensions");
  if (b.shape(1) != d_in)
    throw std::invalid_argument(std::string(op) + ": " + what + " blocks must be [nb, " + std::to_string(d_in) + ", rb]");
  if (!b.flags().row_contiguous)
    throw std::invalid_argument(std::string(op) + ": " + what + " blocks must be a contiguous (evaluated) array");
}

const float* contiguous_2d(const mx::array& a, std::vector<float>& buf) {
  const int64_t R = a.shape(0), C = a.shape(1);
  if (a.strides()[1] == 1 && (a.strides()[0] == C || R == 1)) return a.data<float>();
  View V(a);
  buf.resize(R * C);
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) buf[r * C + c] = V.at(r, c);
  return buf.data();
}

const float* contiguous_1d(const mx::array& a, std::vector<float>& buf) {
  if (a.strides()[0] == 1) return a.data<float>();
  View V(a);
  buf.resize(a.shape(0));
  for (int64_t c = 0; c < a.shape(0); c++) buf[c] = V.at(c);
  return buf.data();
}

std::map<std::string, std::pair<int64_t, double>> profile(bool enable) {
  std::map<std::string, std::pair<int64_t, double>> out;
  for (int k = 0; k < P_KINDS; k++) {
    out[PROF_NAMES[k]] = {prof_calls[k].exchange(0), prof_ns[k].exchange(0) * 1e-9};
  }
  prof_on = enable;
  return out;
}

std::string simd() { return use_avx512() ? "avx512" : (use_avx2() ? "avx2" : "none"); }

bool set_simd(bool enable) { return simd_allowed.exchange(enable ? 2 : 0) > 0; }

std::string set_simd_level(const std::string& level) {
  static const char* names[3] = {"none", "avx2", "avx512"};
  for (int i = 0; i < 3; i++)
    if (level == names[i]) return names[simd_allowed.exchange(i)];
  throw std::invalid_argument("set_simd_level: expected none, avx2 or avx512, not " + level);
}

}  // namespace spel
