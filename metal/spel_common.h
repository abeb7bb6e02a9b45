// Helpers shared by the spel-mlx kernels.  Passed as the `header` of
// mx.fast.metal_kernel, and compiled unchanged by the CPU emulation
// (metal/emu).  Scalar code only: see docs/metal.md.

// sigmoid / silu written once so every kernel (and every token) rounds alike.
inline float spel_sigmoid(float x) { return 1.0f / (1.0f + metal::exp(-x)); }
inline float spel_silu(float x) { return x / (1.0f + metal::exp(-x)); }

// 1 / ||x|| with SPEC 2's eps inside the norm: x / sqrt(sum x^2 + 1e-6).
inline float spel_inv_norm(float sum_sq) { return 1.0f / metal::sqrt(sum_sq + 1e-6f); }

// SPEC 3 ternary code -> weight: 0 -> 0, 1 -> +1, 3 -> -1, 2 -> 0.
inline int spel_ternary_weight(uint32_t code) {
  return int(code & 1u) * (1 - int(code & 2u));
}
