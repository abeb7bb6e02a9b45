/* LP64 CBLAS entry points forwarded to an ILP64 OpenBLAS (numpy's bundled
 * scipy_openblas64_).  MLX's Linux CPU wheel links the reference BLAS; loading
 * this library with RTLD_GLOBAL before mlx.core makes MLX's cblas_sgemm /
 * cblas_dgemm / cblas_cgemm resolve here instead.  The target functions are
 * handed in at run time by spel_mlx._blas (they live in numpy's wheel, whose
 * file name carries a hash), so this file links against nothing. */
#include <stdint.h>

typedef void (*gemm64_fn)(int64_t order, int64_t ta, int64_t tb, int64_t m,
                          int64_t n, int64_t k, const void *alpha, const void *a,
                          int64_t lda, const void *b, int64_t ldb,
                          const void *beta, void *c, int64_t ldc);
typedef void (*sgemm64_fn)(int64_t order, int64_t ta, int64_t tb, int64_t m,
                           int64_t n, int64_t k, float alpha, const float *a,
                           int64_t lda, const float *b, int64_t ldb, float beta,
                           float *c, int64_t ldc);
typedef void (*dgemm64_fn)(int64_t order, int64_t ta, int64_t tb, int64_t m,
                           int64_t n, int64_t k, double alpha, const double *a,
                           int64_t lda, const double *b, int64_t ldb,
                           double beta, double *c, int64_t ldc);

static sgemm64_fn g_sgemm;
static dgemm64_fn g_dgemm;
static gemm64_fn g_cgemm;

int spel_blasshim_init(void *sgemm, void *dgemm, void *cgemm) {
  g_sgemm = (sgemm64_fn)sgemm;
  g_dgemm = (dgemm64_fn)dgemm;
  g_cgemm = (gemm64_fn)cgemm;
  return (g_sgemm && g_dgemm && g_cgemm) ? 0 : -1;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta,
                 float *c, int ldc) {
  g_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha,
                 const double *a, int lda, const double *b, int ldb,
                 double beta, double *c, int ldc) {
  g_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k,
                 const void *alpha, const void *a, int lda, const void *b,
                 int ldb, const void *beta, void *c, int ldc) {
  g_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
