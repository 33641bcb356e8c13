/* The CPU engine's decode-step kernels (AVX2 + FMA, OpenMP): an int8-weight matrix-vector product and
   attention of one query per request over the paged KV pool (further down).

   GEMV: y (M, N) = x (M, K) @ W^T for a few rows M, with W (N, K) in blocks of 32 along K: 32 signed bytes and a
   float32 scale per block, w = q * d (a Q8_0 GGUF weight, such as the default model's tied embedding / head).
   The rows of x are quantized to int8 per block of 32 too (x ~ xq * dx, |xq| <= 127) and the products summed
   in integers, eight lanes at a time; a float dequantize-and-FMA kernel, or a bf16 GEMM on a machine without
   native bf16, spends its time converting instead.

   Threads split the output columns; weights are read once per call whatever M is.

   Built by sgnb.kernels.native with the system C compiler on first use; the Python side checks shapes, and
   the engine uses torch's kernels where this cannot be built. */

#include <immintrin.h>
#include <math.h>
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

/* ---- decode attention over the paged KV pool ------------------------------------------------------------

   One query token per request (q (B, H, D)) over that request's keys: slots req_to_token[rows[b], starts[b] + i]
   for i < lens[b] of the pool k_buf / v_buf (S, Hkv, D) float32; the G = H / Hkv query heads of a KV head share
   its keys. Keys are read in place through the slot table (no gathered copy). The work is split into tasks of
   (request, KV head, chunk of CHUNK keys), each a softmax partial (max, sum, weighted V), merged per head after:
   a lone long request still uses every thread. out (B, H, D) normalized, lse (B, H) natural-log sum of exps
   (-inf and zeros for a request with no keys), so callers can merge with another partial (a shared prefix). */

#define CHUNK 256
#define MAX_GROUP 16

/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
   < 2e-7), 2^n through the exponent bits; x below -87 gives 0 */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    for (; d < D; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    return hsum8(_mm256_add_ps(s0, s1));
}

int sgnb_paged_decode(const float *q, const float *k_buf, const float *v_buf, const int64_t *req_to_token,
                      int64_t row_stride, const int64_t *rows, const int64_t *starts, const int64_t *lens, int64_t B,
                      int64_t H, int64_t Hkv, int64_t D, float scale, float *out, float *lse, int nthreads) {
    if (H % Hkv || H / Hkv > MAX_GROUP || D % 8) return 1;
    const int64_t G = H / Hkv;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first task of each request */
    if (!first) return 2;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + Hkv * ((lens[b] + CHUNK - 1) / CHUNK);
    const int64_t T = first[B];
    float *pm = malloc(sizeof(float) * (size_t)(T * G + 1)), *pl = malloc(sizeof(float) * (size_t)(T * G + 1));
    float *pa = malloc(sizeof(float) * (size_t)(T * G * D + 1));
    if (!pm || !pl || !pa) { free(first); free(pm); free(pl); free(pa); return 2; }

#pragma omp parallel num_threads(nthreads)
    {
        float sc[MAX_GROUP * CHUNK] __attribute__((aligned(32)));
        int64_t b = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < T; t++) {
            while (first[b + 1] <= t) b++;
            while (first[b] > t) b--;
            const int64_t chunks = (lens[b] + CHUNK - 1) / CHUNK, local = t - first[b];
            const int64_t h = local / chunks, c = local % chunks;
            const int64_t i0 = c * CHUNK, n = (lens[b] - i0 < CHUNK) ? lens[b] - i0 : CHUNK;
            const int64_t *sl = req_to_token + rows[b] * row_stride + starts[b] + i0;
            const float *qh = q + (b * H + h * G) * D;
            for (int64_t i = 0; i < n; i++) {
                const float *kp = k_buf + (sl[i] * Hkv + h) * D;
                for (int64_t g = 0; g < G; g++) sc[g * CHUNK + i] = dot(qh + g * D, kp, D) * scale;
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = sc + g * CHUNK, m = -INFINITY;
                for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
                __m256 sum = _mm256_setzero_ps();
                const __m256 mv = _mm256_set1_ps(m);
                int64_t i = 0;
                for (; i + 8 <= n; i += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
                    _mm256_storeu_ps(s + i, e);
                    sum = _mm256_add_ps(sum, e);
                }
                float l = hsum8(sum);
                for (; i < n; i++) { s[i] = expf(s[i] - m); l += s[i]; }
                float *acc = pa + (t * G + g) * D;
                for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
                for (i = 0; i < n; i++) {
                    const float *vp = v_buf + (sl[i] * Hkv + h) * D;
                    const __m256 p = _mm256_set1_ps(s[i]);
                    for (int64_t d = 0; d < D; d += 8)
                        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + d), _mm256_loadu_ps(acc + d)));
                }
                pm[t * G + g] = m;
                pl[t * G + g] = l;
            }
        }
        /* merge each head's chunk partials */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const int64_t bb = bh / H, hh = bh % H, h = hh / G, g = hh % G;
            float *o = out + bh * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            const int64_t chunks = (lens[bb] + CHUNK - 1) / CHUNK;
            if (chunks == 0) { lse[bh] = -INFINITY; continue; }
            float M = -INFINITY, L = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float m = pm[(first[bb] + h * chunks + c) * G + g];
                M = m > M ? m : M;
            }
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t t = first[bb] + h * chunks + c;
                const float w = expf(pm[t * G + g] - M);
                L += w * pl[t * G + g];
                const float *acc = pa + (t * G + g) * D;
                for (int64_t d = 0; d < D; d++) o[d] += w * acc[d];
            }
            for (int64_t d = 0; d < D; d++) o[d] /= L;
            lse[bh] = M + logf(L);
        }
    }
    free(first); free(pm); free(pl); free(pa);
    return 0;
}
