// Ternary GEMV / small GEMM on SPEC 3's canonical 2-bit packing.
// Template: NV (vectors per SIMD group, 1 for GEMV).
//   inputs  w [R, W] uint32 = the packed rows (W = cp / 16 words; 16 weights per
//           word, low bits first, exactly the bytes of quant.pack_ternary);
//           ws [R] f32 row scales; xq [N, cp] int8; sx [N] f32
//   output  y [N, R] = (ws[r] * sx[n]) * float(sum_c q[r,c] * xq[n,c])
// Grid (32, ceil(R / RPS), ceil(N / NV)), threadgroup (32, 4, 1): one SIMD
// group per RPS = 2 rows and NV vectors.  Lane l reads words l, l+32, ... of
// each row (coalesced 128-byte loads) and the 16 matching activation bytes,
// decodes the codes with shifts and accumulates in int32 (exact), then one
// simd_sum per (row, vector).  The integer sum is order-free, so y equals the
// numpy / C reference bit for bit.
constexpr int RPS = 2;
const uint lane = thread_index_in_simdgroup;
const int row0 = int(thread_position_in_grid.y) * RPS;
const int n0 = int(thread_position_in_grid.z) * NV;
const int R = w_shape[0];
const int W = w_shape[1];
const int N = sx_shape[0];
const int cp = W * 16;
if (row0 >= R) {
  return;  // the whole SIMD group leaves together
}
int acc[RPS][NV];
for (int r = 0; r < RPS; ++r) {
  for (int v = 0; v < NV; ++v) {
    acc[r][v] = 0;
  }
}
for (int wi = int(lane); wi < W; wi += 32) {
  uint32_t bits[RPS];
  for (int r = 0; r < RPS; ++r) {
    bits[r] = (row0 + r < R) ? w[(row0 + r) * W + wi] : 0u;
  }
  for (int v = 0; v < NV; ++v) {
    const int n = metal::min(n0 + v, N - 1);  // tail vectors recompute the last one
    const int xo = n * cp + wi * 16;
    int xv[16];
    for (int e = 0; e < 16; ++e) {
      xv[e] = int(xq[xo + e]);
    }
    for (int r = 0; r < RPS; ++r) {
      int part = 0;
      for (int e = 0; e < 16; ++e) {
        part += spel_ternary_weight((bits[r] >> (2 * e)) & 3u) * xv[e];
      }
      acc[r][v] += part;
    }
  }
}
for (int r = 0; r < RPS; ++r) {
  for (int v = 0; v < NV; ++v) {
    const int total = metal::simd_sum(acc[r][v]);
    if (lane == 0 && row0 + r < R && n0 + v < N) {
      y[(n0 + v) * R + row0 + r] = (ws[row0 + r] * sx[n0 + v]) * float(total);
    }
  }
}
