// Causal attention for the M queries of a verification batch against the KV
// cache (this batch's k/v already written at pos0 .. pos0+M-1), blocked over keys
// with an online softmax (flash-style), as the CPU kernel (cpu_ext/attend_blocked.cpp).
// Template: HD (32, 64 or 128), ROPE_Q (0/1).
//   inputs  q [M, H, HD]; k_cache, v_cache [>= pos0+M, H, HD] (rotated k);
//           pos0 (int32 scalar); inv_freq [HD/2] = theta^(-2i/HD)
//           ROPE_Q = 0: q is already normalized and rotated (inv_freq unused).
//           ROPE_Q = 1: q is the raw projection; it is L2-normalized (eps
//           inside the norm) and rotated here on pairs (2i, 2i+1) by the angle
//           float(pos) * inv_freq[i].
//   output  o [M, H, HD]; softmax logits sqrt(HD) * (q . k); query j sees keys
//           0 .. pos0 + j.
// Grid (128, ceil(M / QT), H), threadgroup (128, 1, 1): one threadgroup per (tile of
// QT queries, head).  The keys go by in blocks of BK: the block's K and V rows are
// read from device memory ONCE for the whole tile into threadgroup memory; SIMD group
// sg scores queries sg, sg + 4, ... (lane l: key c0 + l, its full dot product with q;
// the causal mask inside the block), with the block max and sum by simd_max /
// simd_sum; then thread t accumulates (query, dim) pairs t, t + 128, ... over the
// block's keys in order.  exp is exp2 of scores already scaled by log2(e).
// Each query walks the same absolute blocks 0, BK, 2 BK, ... up to its own last key
// with its own running max, sum and accumulators, and the lanes hold the same values
// whichever tile and SIMD group it is in, so a query's result is the same whatever M
// and j are (strict mode's batched == sequential holds bit for bit).
constexpr int NT = 128;
constexpr int NSG = NT / 32;
constexpr int QT = 8;                      // queries per threadgroup
constexpr int QPS = QT / NSG;              // queries per SIMD group
constexpr int BK = HD == 128 ? 16 : 32;    // keys per block (<= 32: one per lane)
constexpr int KST = HD + 1;                // k row stride in threadgroup memory: no bank conflicts
constexpr int PAIRS = QT * HD / NT;        // (query, dim) accumulators per thread
threadgroup float q_sh[QT * HD];
threadgroup float k_sh[BK * KST];
threadgroup float v_sh[BK * HD];
threadgroup float p_sh[QT * BK];
threadgroup float alpha_sh[QT];
threadgroup float l_sh[QT];

const uint t = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int j0 = int(threadgroup_position_in_grid.y) * QT;
const int h = int(threadgroup_position_in_grid.z);
const int M = q_shape[0];
const int H = q_shape[1];
const int nq = metal::min(QT, M - j0);     // queries of this tile
const int nkeys = pos0 + j0 + nq;          // keys its last query sees

for (int e = int(t); e < nq * HD; e += NT) {
  q_sh[e] = q[((j0 + e / HD) * H + h) * HD + e % HD];
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
if (ROPE_Q) {
  if (int(t) < nq) {
    float ss = 0.0f;
    for (int c = 0; c < HD; ++c) {
      ss += q_sh[int(t) * HD + c] * q_sh[int(t) * HD + c];
    }
    l_sh[t] = spel_inv_norm(ss);
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float rotated[PAIRS];
  for (int a = 0; a < PAIRS; ++a) {
    const int e = int(t) + a * NT;
    const int jl = e / HD;
    rotated[a] = 0.0f;
    if (jl < nq) {
      const int pair = (e % HD) / 2;
      const float ang = float(pos0 + j0 + jl) * inv_freq[pair];
      const float cs = metal::cos(ang);
      const float sn = metal::sin(ang);
      const float x0 = q_sh[jl * HD + 2 * pair] * l_sh[jl];
      const float x1 = q_sh[jl * HD + 2 * pair + 1] * l_sh[jl];
      rotated[a] = (e & 1) ? (x0 * sn + x1 * cs) : (x0 * cs - x1 * sn);
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  for (int a = 0; a < PAIRS; ++a) {
    const int e = int(t) + a * NT;
    if (e < nq * HD) {
      q_sh[e] = rotated[a];
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}

const float scale = metal::sqrt(float(HD)) * 1.4426950408889634f;   // log2 units
float m_run[QPS];
float l_run[QPS];
for (int i = 0; i < QPS; ++i) {
  m_run[i] = -INFINITY;
  l_run[i] = 0.0f;
}
float acc[PAIRS];
for (int a = 0; a < PAIRS; ++a) {
  acc[a] = 0.0f;
}
for (int c0 = 0; c0 < nkeys; c0 += BK) {
  const int nb = metal::min(BK, nkeys - c0);
  for (int e = int(t); e < nb * HD; e += NT) {
    const int row = ((c0 + e / HD) * H + h) * HD + e % HD;
    k_sh[(e / HD) * KST + e % HD] = k_cache[row];
    v_sh[e] = v_cache[row];
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  for (int i = 0; i < QPS; ++i) {
    const int jl = int(sg) + i * NSG;
    const int P = pos0 + j0 + jl;            // this query's last key
    if (jl < nq && c0 <= P) {                // uniform in the SIMD group
      float s = -INFINITY;
      if (int(lane) < BK && c0 + int(lane) <= P) {
        float dot = 0.0f;
        for (int c = 0; c < HD; ++c) {
          dot += q_sh[jl * HD + c] * k_sh[int(lane) * KST + c];
        }
        s = dot * scale;
      }
      const float m_new = metal::max(m_run[i], metal::simd_max(s));
      const float p = s == -INFINITY ? 0.0f : metal::exp2(s - m_new);
      const float alpha = metal::exp2(m_run[i] - m_new);    // 0 on the first block
      l_run[i] = l_run[i] * alpha + metal::simd_sum(p);
      m_run[i] = m_new;
      if (int(lane) < BK) {
        p_sh[jl * BK + int(lane)] = p;
      }
      if (lane == 0) {
        alpha_sh[jl] = alpha;
      }
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  for (int a = 0; a < PAIRS; ++a) {
    const int e = int(t) + a * NT;
    const int jl = e / HD;
    const int seen = pos0 + j0 + jl + 1 - c0;   // keys of this block the query sees
    if (jl < nq && seen > 0) {
      const int d = e % HD;
      float sum = 0.0f;
      for (int l = 0; l < metal::min(nb, seen); ++l) {
        sum += p_sh[jl * BK + l] * v_sh[l * HD + d];
      }
      acc[a] = acc[a] * alpha_sh[jl] + sum;
    }
  }
  // k_sh, v_sh, p_sh and alpha_sh are rewritten by the next block
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}
if (lane == 0) {
  for (int i = 0; i < QPS; ++i) {
    if (int(sg) + i * NSG < nq) {
      l_sh[int(sg) + i * NSG] = l_run[i];
    }
  }
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
for (int a = 0; a < PAIRS; ++a) {
  const int e = int(t) + a * NT;
  const int jl = e / HD;
  if (jl < nq) {
    o[((j0 + jl) * H + h) * HD + e % HD] = acc[a] / l_sh[jl];
  }
}
