/* Standalone self-test of the engine's C sources, for running the NEON kernels on a
 * non-arm64 host: tests/test_neon_qemu.py cross-compiles this file with the SAME
 * sources (aarch64-linux-gnu-gcc -march=armv8.2-a+dotprod -static) and runs it under
 * qemu-aarch64.
 *
 *   selftest kernels                 all available kernels: identical int32 dots (ternary
 *                                    and q8) on random and edge inputs; prints a summary
 *   selftest quant IN OUT            IN: u32 rows, u32 cols, f32 w[rows*cols]; OUT: q8 q, q8 s,
 *                                    ternary t, ternary s, packed ternary, activation of row 0
 *   selftest draft IN OUT KERNEL T   IN: draft weights + tokens (format in test_neon_qemu.py);
 *                                    OUT: f32 logits[n][V] fed one token per step
 * Exit status 0 on success; errors go to stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../spel_internal.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static int check_kernels(void) {
    static const int64_t shapes[][2] = {{1, 64}, {3, 100}, {17, 384}, {8, 1000}, {5, 1536}, {2, 1}, {4, 130}};
    int avail[SPEL_KERNEL_COUNT], navail = 0;
    for (int k = 0; k < SPEL_KERNEL_COUNT; k++) {
        avail[k] = spel_kernel_available(k);
        if (avail[k]) { printf("available %s\n", spel_kernel_name(k)); navail++; }
    }
    int64_t compared = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t R = shapes[s][0], C = shapes[s][1], rb = spel_ternary_row_bytes(C);
        uint8_t *packed = malloc((size_t)(R * rb));
        int8_t *q = malloc((size_t)(R * C)), *x = malloc((size_t)C);
        int32_t *ref_t = malloc(4 * (size_t)R), *ref_q = malloc(4 * (size_t)R), *out = malloc(4 * (size_t)R);
        for (int mode = 0; mode < 4; mode++) {   /* random, +127, -127, all-zero activations */
            for (int64_t i = 0; i < R * rb; i++) packed[i] = (uint8_t)rnd();   /* includes code 2 */
            for (int64_t i = 0; i < R; i++)   /* canonical rows: padding weights are code 0 */
                for (int64_t j = C; j < rb * 4; j++) packed[i * rb + j / 4] &= (uint8_t)~(3u << (2 * (j & 3)));
            for (int64_t i = 0; i < R * C; i++) q[i] = (int8_t)((int)(rnd() % 255) - 127);
            for (int64_t j = 0; j < C; j++)
                x[j] = mode == 0 ? (int8_t)((int)(rnd() % 255) - 127) : mode == 1 ? 127 : mode == 2 ? -127 : 0;
            if (mode == 1) for (int64_t i = 0; i < R * C; i++) q[i] = 127;
            spel_dot_ternary(SPEL_KERNEL_SCALAR, packed, R, C, x, ref_t);
            spel_dot_q8(SPEL_KERNEL_SCALAR, q, R, C, x, ref_q);
            /* scalar itself against a direct decode */
            for (int64_t i = 0; i < R; i++) {
                int32_t acc = 0;
                for (int64_t j = 0; j < C; j++) {
                    int code = (packed[i * rb + j / 4] >> (2 * (j & 3))) & 3;
                    acc += (code == 1 ? 1 : code == 3 ? -1 : 0) * x[j];
                }
                if (acc != ref_t[i]) { fprintf(stderr, "scalar ternary wrong at %lldx%lld\n", (long long)R, (long long)C); return 1; }
            }
            for (int k = 0; k < SPEL_KERNEL_COUNT; k++) {
                if (!avail[k]) continue;
                spel_dot_ternary(k, packed, R, C, x, out);
                if (memcmp(out, ref_t, 4 * (size_t)R)) {
                    fprintf(stderr, "ternary kernel %s differs at %lldx%lld mode %d\n", spel_kernel_name(k), (long long)R, (long long)C, mode);
                    return 1;
                }
                spel_dot_q8(k, q, R, C, x, out);
                if (memcmp(out, ref_q, 4 * (size_t)R)) {
                    fprintf(stderr, "q8 kernel %s differs at %lldx%lld mode %d\n", spel_kernel_name(k), (long long)R, (long long)C, mode);
                    return 1;
                }
                compared += 2 * R;
            }
        }
        free(packed); free(q); free(x); free(ref_t); free(ref_q); free(out);
    }
    printf("kernels %d agree on %lld row dots\n", navail, (long long)compared);
    return 0;
}

static void *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return NULL; }
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc((size_t)sz + 1);
    if (fread(buf, 1, (size_t)sz, f) != (size_t)sz) { fclose(f); free(buf); return NULL; }
    fclose(f);
    *n = (size_t)sz;
    return buf;
}

static int quant_file(const char *in, const char *outp) {
    size_t n;
    uint32_t *hdr = read_all(in, &n);
    if (!hdr) return 1;
    int64_t R = hdr[0], C = hdr[1];
    const float *w = (const float *)(hdr + 2);
    int8_t *q = malloc((size_t)(R * C)), *t = malloc((size_t)(R * C)), *xq = malloc((size_t)C);
    float *sq = malloc(4 * (size_t)R), *st = malloc(4 * (size_t)R);
    int64_t rb = spel_ternary_row_bytes(C);
    uint8_t *packed = malloc((size_t)(R * rb));
    spel_quantize_q8(w, R, C, q, sq);
    spel_quantize_ternary(w, R, C, t, st);
    spel_pack_ternary(t, R, C, packed);
    float sx = spel_quantize_activation(w, C, xq);
    FILE *f = fopen(outp, "wb");
    fwrite(q, 1, (size_t)(R * C), f);
    fwrite(sq, 4, (size_t)R, f);
    fwrite(t, 1, (size_t)(R * C), f);
    fwrite(st, 4, (size_t)R, f);
    fwrite(packed, 1, (size_t)(R * rb), f);
    fwrite(xq, 1, (size_t)C, f);
    fwrite(&sx, 4, 1, f);
    fclose(f);
    return 0;
}

static int draft_file(const char *in, const char *outp, int kernel, int threads) {
    size_t n;
    int32_t *buf = read_all(in, &n);
    if (!buf) return 1;
    /* i32 d_model, n_heads, head_dim, d_ff, vocab, max_seq, n_layers, ring, kinds[n_layers];
     * f32 rope_theta, norm_eps; f32 tensors; i32 ntok, tokens[ntok] */
    spel_draft_config c = {buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7], 0, 0, threads, kernel, 0};
    const int32_t *kinds = buf + 8;
    const float *fp = (const float *)(kinds + c.n_layers);
    c.rope_theta = fp[0];
    c.norm_eps = fp[1];
    fp += 2;
    int d = c.d_model, inner = c.n_heads * c.head_dim, ff = c.d_ff, V = c.vocab, H = c.n_heads;
    spel_draft *dr = spel_draft_new(&c, kinds);
    const float *emb = fp; fp += (size_t)V * d;
    const float *fn = fp; fp += d;
    const float *head = fp; fp += (size_t)V * d;
    spel_draft_set_shared(dr, emb, fn, head);
    for (int l = 0; l < c.n_layers; l++) {
        const float *an = fp; fp += d;
        const float *conv = NULL, *dl = NULL, *bl = NULL;
        if (kinds[l] == SPEL_LAYER_GDN) { conv = fp; fp += 3 * d; }
        const float *wqkv = fp; fp += (size_t)3 * inner * d;
        const float *wo = fp; fp += (size_t)d * inner;
        if (kinds[l] == SPEL_LAYER_GDN) { dl = fp; fp += H; bl = fp; fp += H; }
        const float *fnw = fp; fp += d;
        const float *w1 = fp; fp += (size_t)ff * d;
        const float *w3 = fp; fp += (size_t)ff * d;
        const float *w2 = fp; fp += (size_t)d * ff;
        spel_draft_set_layer(dr, l, an, conv, wqkv, wo, dl, bl, fnw, w1, w3, w2);
    }
    if (spel_draft_ready(dr)) { fprintf(stderr, "draft: %s\n", spel_draft_error(dr)); return 1; }
    const int32_t *tp = (const int32_t *)fp;
    int ntok = tp[0];
    float *logits = malloc(4 * (size_t)ntok * V);
    for (int i = 0; i < ntok; i++)
        if (spel_draft_step(dr, tp[1 + i], logits + (size_t)i * V)) { fprintf(stderr, "step: %s\n", spel_draft_error(dr)); return 1; }
    printf("draft kernel=%s threads=%d tokens=%d\n", spel_kernel_name(spel_draft_kernel(dr)), spel_draft_threads(dr), ntok);
    FILE *f = fopen(outp, "wb");
    fwrite(logits, 4, (size_t)ntok * V, f);
    fclose(f);
    spel_draft_free(dr);
    free(logits);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "kernels")) return check_kernels();
    if (argc >= 4 && !strcmp(argv[1], "quant")) return quant_file(argv[2], argv[3]);
    if (argc >= 6 && !strcmp(argv[1], "draft")) return draft_file(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]));
    fprintf(stderr, "usage: selftest kernels | quant IN OUT | draft IN OUT KERNEL THREADS\n");
    return 2;
}
