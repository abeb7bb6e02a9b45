// GDN causal depthwise 3-tap convolution + SiLU over the M tokens of a batch.
//   inputs  x [M, d] (normed layer input), tail [2, d] (x_{-2}, x_{-1}),
//           conv [3, d]
//   outputs u [M, d] = silu(conv[0]*x_{t-2} + conv[1]*x_{t-1} + conv[2]*x_t),
//           tails [M, 2, d] = the last two inputs after token j (ring slot j)
// Grid (ceil(d / 64) * 64, 1, 1), threadgroup (64, 1, 1): one thread per
// channel walks the tokens in order with the two previous inputs in registers,
// so token j's arithmetic does not depend on M (strict mode is bit-stable).
const uint c = thread_position_in_grid.x;
const int M = x_shape[0];
const int d = x_shape[1];
if (int(c) >= d) {
  return;
}
float x2 = tail[c];
float x1 = tail[d + c];
const float w0 = conv[c];
const float w1 = conv[d + c];
const float w2 = conv[2 * d + c];
for (int j = 0; j < M; ++j) {
  const float x0 = x[j * d + int(c)];
  const float z = (w0 * x2 + w1 * x1) + w2 * x0;
  u[j * d + int(c)] = spel_silu(z);
  x2 = x1;
  x1 = x0;
  tails[(2 * j) * d + int(c)] = x2;
  tails[(2 * j + 1) * d + int(c)] = x1;
}
