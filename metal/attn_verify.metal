// Causal attention for the M queries of a verification batch against the KV
// cache (this batch's k/v already written at pos0 .. pos0+M-1).
// Template: HD (32, 64 or 128), ROPE_Q (0/1).
//   inputs  q [M, H, HD]; k_cache, v_cache [>= pos0+M, H, HD] (rotated k);
//           pos0 (int32 scalar); inv_freq [HD/2] = theta^(-2i/HD)
//           ROPE_Q = 0: q is already normalized and rotated (inv_freq unused).
//           ROPE_Q = 1: q is the raw projection; it is L2-normalized (eps
//           inside the norm) and rotated here on pairs (2i, 2i+1) by the angle
//           float(pos) * inv_freq[i].
//   output  o [M, H, HD]; softmax logits sqrt(HD) * (q . k); query j sees keys
//           0 .. pos0 + j.
// Grid (128, M, H), threadgroup (128, 1, 1): one threadgroup per (query, head).
// Keys are processed in chunks of CHUNK: each thread scores keys e = t,
// t + 128, ... of the chunk (its own full dot product, scores kept in
// threadgroup memory), the chunk max and sum are reduced with simd_max /
// simd_sum plus a fixed-order pass over the 4 SIMD groups, then thread t
// accumulates output dim t % HD over keys t / HD, t / HD + KSPLIT, ... (loads
// of v rows are coalesced across threads).  Every partition depends only on the
// absolute key index, so a query's result is the same whatever M and j are
// (strict mode's batched == sequential holds bit for bit).
constexpr int NT = 128;
constexpr int NSG = NT / 32;
constexpr int KSPLIT = NT / HD;
constexpr int CHUNK = 1024;
threadgroup float q_sh[HD];
threadgroup float scores[CHUNK];
threadgroup float red[NSG];
threadgroup float acc_sh[NT];

const uint t = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int j = int(threadgroup_position_in_grid.y);
const int h = int(threadgroup_position_in_grid.z);
const int H = q_shape[1];
const int P = pos0 + j;  // absolute position of this query
const int nkeys = P + 1;
const int row = (j * H + h) * HD;

if (t < HD) {
  q_sh[t] = q[row + int(t)];
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
if (ROPE_Q) {
  float ss = 0.0f;
  for (int c = 0; c < HD; ++c) {
    ss += q_sh[c] * q_sh[c];
  }
  const float inv = spel_inv_norm(ss);
  float rotated = 0.0f;
  if (t < HD) {
    const uint pair = t / 2;
    const float ang = float(P) * inv_freq[pair];
    const float cs = metal::cos(ang);
    const float sn = metal::sin(ang);
    const float x0 = q_sh[2 * pair] * inv;
    const float x1 = q_sh[2 * pair + 1] * inv;
    rotated = (t & 1u) ? (x0 * sn + x1 * cs) : (x0 * cs - x1 * sn);
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  if (t < HD) {
    q_sh[t] = rotated;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}

const float scale = metal::sqrt(float(HD));
const int dim = int(t) % HD;
const int part = int(t) / HD;
float m_run = -INFINITY;
float l_run = 0.0f;
float acc = 0.0f;
for (int c0 = 0; c0 < nkeys; c0 += CHUNK) {
  const int n = metal::min(CHUNK, nkeys - c0);
  float cmax = -INFINITY;
  for (int e = int(t); e < n; e += NT) {
    const int krow = ((c0 + e) * H + h) * HD;
    float dot = 0.0f;
    for (int c = 0; c < HD; ++c) {
      dot += q_sh[c] * k_cache[krow + c];
    }
    const float sc = scale * dot;
    scores[e] = sc;
    cmax = metal::max(cmax, sc);
  }
  cmax = metal::simd_max(cmax);
  if (lane == 0) {
    red[sg] = cmax;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float m_new = m_run;
  for (int g = 0; g < NSG; ++g) {
    m_new = metal::max(m_new, red[g]);
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float csum = 0.0f;
  for (int e = int(t); e < n; e += NT) {
    const float p = metal::exp(scores[e] - m_new);
    scores[e] = p;
    csum += p;
  }
  csum = metal::simd_sum(csum);
  if (lane == 0) {
    red[sg] = csum;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (int g = 0; g < NSG; ++g) {
    total += red[g];
  }
  const float corr = metal::exp(m_run - m_new);  // 0 on the first chunk
  l_run = l_run * corr + total;
  acc *= corr;
  for (int e = part; e < n; e += KSPLIT) {
    acc += scores[e] * v_cache[((c0 + e) * H + h) * HD + dim];
  }
  m_run = m_new;
  // scores and red are rewritten by the next chunk
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}
acc_sh[t] = acc;
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
if (t < HD) {
  float out = 0.0f;
  for (int g = 0; g < KSPLIT; ++g) {
    out += acc_sh[g * HD + int(t)];
  }
  o[row + int(t)] = out / l_run;
}
