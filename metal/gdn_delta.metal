// Gated-DeltaNet delta rule over the M = K+1 tokens of a verification batch,
// writing the state after EVERY token (the rollback ring's slots), not just the
// last one.  Template: HD (head_dim, a multiple of 32), FUSED (0/1).
//   inputs  q, k, v [M, H, HD]; decay, beta [H]; s0 [H, HD, HD] (committed S)
//           FUSED = 0: q, k already L2-normalized, decay = a, beta = beta.
//           FUSED = 1: q, k raw projections (normalized here, eps inside the
//           norm) and decay/beta are the logits (sigmoid taken here).
//   outputs o [M, H, HD] = S_t q_t / sqrt(HD); s_all [M, H, HD, HD] = S_t
// Grid (32, HD, H), threadgroup (32, 4, 1): one SIMD group per row i of S_h
// (rows index v, columns index k).  Rows evolve independently:
//   r = S[i,:] . k;  S[i,:] = a S[i,:] + beta (v_i - r) k;  o_i = S[i,:] . q
// so a row needs only its own registers plus two simd_sum per token.  Lane l
// keeps columns l, l+32, ... in registers across the whole batch; its stores of
// s_all are coalesced 128-byte rows.
constexpr int NPL = HD / 32;  // columns per lane
const uint lane = thread_position_in_grid.x;
const uint i = thread_position_in_grid.y;
const uint h = thread_position_in_grid.z;
const int M = q_shape[0];
const int H = q_shape[1];

float a_h = decay[h];
float b_h = beta[h];
if (FUSED) {
  a_h = spel_sigmoid(a_h);
  b_h = spel_sigmoid(b_h);
}
float s[NPL];
for (int c = 0; c < NPL; ++c) {
  s[c] = s0[(h * HD + i) * HD + lane + 32 * c];
}
const float sqrt_hd = metal::sqrt(float(HD));
for (int j = 0; j < M; ++j) {
  const int base = (j * H + int(h)) * HD;
  float kc[NPL];
  float qc[NPL];
  for (int c = 0; c < NPL; ++c) {
    kc[c] = k[base + lane + 32 * c];
    qc[c] = q[base + lane + 32 * c];
  }
  if (FUSED) {
    float kk = 0.0f;
    float qq = 0.0f;
    for (int c = 0; c < NPL; ++c) {
      kk += kc[c] * kc[c];
      qq += qc[c] * qc[c];
    }
    const float k_inv = spel_inv_norm(metal::simd_sum(kk));
    const float q_inv = spel_inv_norm(metal::simd_sum(qq));
    for (int c = 0; c < NPL; ++c) {
      kc[c] *= k_inv;
      qc[c] *= q_inv;
    }
  }
  float r = 0.0f;
  for (int c = 0; c < NPL; ++c) {
    r += s[c] * kc[c];
  }
  r = metal::simd_sum(r);
  const float err = b_h * (v[base + int(i)] - r);
  float oi = 0.0f;
  const int slot = ((j * H + int(h)) * HD + int(i)) * HD;
  for (int c = 0; c < NPL; ++c) {
    s[c] = a_h * s[c] + err * kc[c];
    oi += s[c] * qc[c];
    s_all[slot + lane + 32 * c] = s[c];
  }
  oi = metal::simd_sum(oi);
  if (lane == 0) {
    o[base + int(i)] = oi / sqrt_hd;
  }
}
