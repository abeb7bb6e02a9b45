// SPEC 3 dynamic per-vector int8 activation quantization for the ternary GEMV:
//   s_x = max|x| / 127, x_q = round(x / s_x) (half to even, like numpy and the
//   C draft) in [-127, 127]; an all-zero vector gives zeros and s_x = 0.
//   inputs  x [N, C] f32; cp (int32 scalar) = C rounded up to 64
//   outputs xq [N, cp] int8 (zero padded), sx [N] f32
// Grid (256, N, 1), threadgroup (256, 1, 1): one threadgroup per vector.  The
// max is exact in any order and x / s_x uses precise::divide (correctly
// rounded), so the codes equal the numpy reference bit for bit.
constexpr int NT = 256;
constexpr int NSG = NT / 32;
threadgroup float red[NSG];
const uint t = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int n = int(threadgroup_position_in_grid.y);
const int C = x_shape[1];
const int xr = n * C;
float amax = 0.0f;
for (int c = int(t); c < C; c += NT) {
  amax = metal::max(amax, metal::fabs(x[xr + c]));
}
amax = metal::simd_max(amax);
if (lane == 0) {
  red[sg] = amax;
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
amax = 0.0f;
for (int g = 0; g < NSG; ++g) {
  amax = metal::max(amax, red[g]);
}
const float s = amax / 127.0f;
if (t == 0) {
  sx[n] = s;
}
for (int c = int(t); c < cp; c += NT) {
  int qv = 0;
  if (c < C && s > 0.0f) {
    qv = int(metal::rint(metal::precise::divide(x[xr + c], s)));
    qv = metal::clamp(qv, -127, 127);
  }
  xq[n * cp + c] = int8_t(qv);
}
