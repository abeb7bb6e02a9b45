// q8 GEMV / small GEMM (the draft's wqkv / wo on the GPU), SPEC 3 q8 weights
// with per-vector int8 activations.  Template: NV (vectors per SIMD group).
//   inputs  w [R, cp] int8 = q8 rows zero-padded to cp = C rounded up to 64
//           (kernels.pad_q8_rows; the padding meets xq's zero padding);
//           ws [R] f32 row scales; xq [N, cp] int8; sx [N] f32
//   output  y [N, R] = (ws[r] * sx[n]) * float(sum_c w[r,c] * xq[n,c])
// Grid (32, ceil(R / RPS) rounded to 4, ceil(N / NV)), threadgroup (32, 4, 1):
// the layout of tern_gemv.  Lane l takes the 16-column chunks l, l+32, ... of
// each row (512 contiguous bytes per SIMD group per step); int32 sums are exact,
// so y equals quant.gemv_q8_ref bit for bit.
constexpr int RPS = 2;
const uint lane = thread_index_in_simdgroup;
const int row0 = int(thread_position_in_grid.y) * RPS;
const int n0 = int(thread_position_in_grid.z) * NV;
const int R = w_shape[0];
const int cp = w_shape[1];
const int N = sx_shape[0];
const int chunks = cp / 16;
if (row0 >= R) {
  return;  // the whole SIMD group leaves together
}
int acc[RPS][NV];
for (int r = 0; r < RPS; ++r) {
  for (int v = 0; v < NV; ++v) {
    acc[r][v] = 0;
  }
}
for (int ci = int(lane); ci < chunks; ci += 32) {
  for (int v = 0; v < NV; ++v) {
    const int n = metal::min(n0 + v, N - 1);  // tail vectors recompute the last one
    const int xo = n * cp + ci * 16;
    int xv[16];
    for (int e = 0; e < 16; ++e) {
      xv[e] = int(xq[xo + e]);
    }
    for (int r = 0; r < RPS; ++r) {
      const int row = metal::min(row0 + r, R - 1);  // a missing last row is never stored
      const int wo = row * cp + ci * 16;
      int part = 0;
      for (int e = 0; e < 16; ++e) {
        part += int(w[wo + e]) * xv[e];
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
