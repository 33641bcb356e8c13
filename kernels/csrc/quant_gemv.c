/* An int8-weight matrix-vector product for the CPU engine's decode steps (AVX2 + FMA, OpenMP).

   y (M, N) = x (M, K) @ W^T for a few rows M, with W (N, K) in blocks of 32 along K: 32 signed bytes and a
   float32 scale per block, w = q * d (a Q8_0 GGUF weight, such as the default model's tied embedding / head).
   The rows of x are quantized to int8 per block of 32 too (x ~ xq * dx, |xq| <= 127) and the products summed
   in integers, eight lanes at a time; a float dequantize-and-FMA kernel, or a bf16 GEMM on a machine without
   native bf16, spends its time converting instead.

   Threads split the output columns; weights are read once per call whatever M is. Built by sgnb.kernels.native
   with the system C compiler on first use; the Python side checks shapes and falls back to torch without it. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x (M, K) -> xq (M, K) int8 and dx (M, K / 32), each block's scale max |x| / 127 (round to nearest). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx) {
    const int64_t G = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < M * G; r++) {
        const float *p = x + r * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.0f;
        const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i i32[4];
        for (int i = 0; i < 4; i++)
            i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT));
        /* pack 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes: undo with a permute) */
        __m256i a = _mm256_packs_epi32(i32[0], i32[1]);
        __m256i b = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i c = _mm256_packs_epi16(a, b);
        c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + r * QK), c);
        dx[r] = d;
    }
}

#define MAX_ROWS 16

int sgnb_q8_gemv(const int8_t *wq, const float *wd, const float *x, float *y, int64_t M, int64_t K, int64_t N,
                 int nthreads) {
    if (M > MAX_ROWS || K % QK) return 1;
    const int64_t G = K / QK;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *dx = malloc(sizeof(float) * (size_t)(M * G));
    if (!xq || !dx) { free(xq); free(dx); return 2; }
    quantize_rows(x, M, K, xq, dx);
    const __m256i ones = _mm256_set1_epi16(1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        __m256 acc[MAX_ROWS];
        for (int64_t r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
        const int8_t *wr = wq + n * K;
        const float *dr = wd + n * G;
        for (int64_t g = 0; g < G; g++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + g * QK));
            const __m256i aw = _mm256_sign_epi8(w, w);  /* |w| as the unsigned operand, w's sign moved to x */
            const float d = dr[g];
            for (int64_t r = 0; r < M; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * dx[r * G + g]), acc[r]);
            }
        }
        for (int64_t r = 0; r < M; r++) y[r * N + n] = hsum8(acc[r]);
    }
    free(xq); free(dx);
    return 0;
}

/* the activations' rounding as the kernels see it, for tests: xq (M, K) int8 and dx (M, K / 32) */
int sgnb_quantize_rows(const float *x, int8_t *xq, float *dx, int64_t M, int64_t K) {
    if (K % QK) return 1;
    quantize_rows(x, M, K, xq, dx);
    return 0;
}
