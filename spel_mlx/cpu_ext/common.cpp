// The primitive base, the argument checks, and the module's switches: which SIMD
// variant runs, and the per-kind timing of the bodies.
#include "common.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
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
// vector load; the copy starts on a cache line.
mx::array aligned_copy(const mx::array& a) {
  if (!a.is_available() || !a.flags().row_contiguous)
    throw std::invalid_argument("aligned_copy: expected an evaluated row-contiguous array");
  constexpr uintptr_t LINE = 64;
  auto d = mx::allocator::malloc(a.nbytes() + LINE);
  const auto raw = reinterpret_cast<uintptr_t>(d.buffer().raw_ptr());
  const int64_t off = static_cast<int64_t>((LINE - (raw & (LINE - 1))) & (LINE - 1));
  mx::Strides strides(a.ndim(), 1);
  for (int i = static_cast<int>(a.ndim()) - 2; i >= 0; i--) strides[i] = strides[i + 1] * a.shape(i + 1);
  mx::array out(a.shape(), a.dtype(), nullptr, {});
  out.set_data(std::move(d), a.size(), strides, a.flags(), off);
  std::memcpy(out.data<char>(), a.data<char>(), a.nbytes());
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
