/* The CPU engine's decode-step kernels (AVX2 + FMA; threads of our own, OpenMP for the module path's elementwise
   kernels): int8- and int4-weight matrix-vector products,
   attention of one query per request over the paged KV pool, and a whole Llama decode forward made of them
   (further down).

   GEMV: y (M, N) = x (M, K) @ W^T for a few rows M, with W (N, K) in blocks of 32 along K: 32 signed bytes and a
   float32 scale per block, w = q * d (a Q8_0 GGUF weight, such as the default model's tied embedding / head).
   The rows of x are quantized to int8 per block of 32 too (x ~ xq * dx, |xq| <= 127) and the products summed
   in integers, eight lanes at a time; a float dequantize-and-FMA kernel, or a bf16 GEMM on a machine without
   native bf16, spends its time converting instead.

   Threads split the output columns; weights are read once per call whatever M is. Several rows are
   compute-bound (the integer multiplies' ports): there each unpacked weight block serves four rows and each
   row's block two columns, the accumulators in registers (the default model's four linears of a layer at 16
   rows: 57 -> 39 us a row on the AVX-512 Xeon of 2026-12-02, AVX2 code; a dense fp32 GEMM then wins from ~24 rows with the
   weights in cache). Where the CPU has AVX-512 VNNI (sgnb_set_isa), vpdpbusd does the integer part on
   whole tiles: 1.3-1.4x the AVX2 tiles there at 4-64 rows.

   Built by sgnb.kernels.native with the system C compiler on first use; the Python side checks shapes, and
   the engine uses torch's kernels where this cannot be built. */

#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define QK 32

/* ---- our threads ------------------------------------------------------------------------------------------

   The GEMVs and attention split their work over a pool of our own threads, not OpenMP. libgomp spins a waiting
   thread only while it manages no more threads than there are CPUs; an engine has at least two threads that
   ran OpenMP work (the one that loaded the model, the scheduler's), so each parallel region then put its
   worker to sleep and woke it through the kernel: on the 2-core EPYC a decode step's ~150 regions took the
   120 int4 GEMVs from 1.7 to 4.6 ms, and the step ran no faster on two threads than on one. Our workers spin
   (pause) between jobs for SPIN_NS, then sleep on a condition variable until the next job: inside one forward
   they never sleep, between steps they wake once.

   par_for(n, body, ctx, nth, interleave) runs body(ctx, i) for i in [0, n) on nth threads (the caller is
   thread 0): contiguous shares (a GEMV's columns, each thread streaming its own stretch of weights) or, with
   interleave, i = ith, ith + nth, ... (attention tasks of uneven size). One job at a time: a call while
   another thread's job runs (two engines in one process) runs serially on its own thread. */

#define MAX_THREADS 64
#define SPIN_NS 300000 /* a worker's busy wait for the next job before it sleeps */

typedef void (*body_fn)(const void *ctx, int64_t i);

static struct {
    pthread_mutex_t busy;  /* held by the thread whose job runs */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    _Atomic uint64_t job;  /* the workers' signal: a count of jobs << 8 | this job's thread count, one word, so a
                              worker that takes no part in a job never reads the next job's fields */
    _Atomic int pending;   /* workers still on this job */
    _Atomic int sleepers;
    int started;           /* workers running (threads 1 .. started) */
    pid_t pid;             /* the process that started them (a fork's child starts its own) */
    body_fn fn;  /* the job: written while no worker runs, read by its workers only */
    const void *ctx;
    int64_t n;
    int interleave;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void run_share(int ith, int64_t nth) {
    const int64_t n = pool.n;
    if (pool.interleave) {
        for (int64_t i = ith; i < n; i += nth) pool.fn(pool.ctx, i);
    } else {
        const int64_t lo = n * ith / nth, hi = n * (ith + 1) / nth;
        for (int64_t i = lo; i < hi; i++) pool.fn(pool.ctx, i);
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static uint64_t pool_first_job[MAX_THREADS];  /* the job count when each worker was made: it waits for the next */

static void *pool_worker(void *arg) {
    const int ith = (int)(intptr_t)arg;
    uint64_t seen = pool_first_job[ith] >> 8;  /* (not the count when it starts running: the job may be out) */
    for (;;) {
        uint64_t job;
        int64_t since = 0;
        for (unsigned spins = 1; ((job = atomic_load_explicit(&pool.job, memory_order_acquire)) >> 8) == seen; spins++) {
            _mm_pause();
            if (spins % 256) continue;
            const int64_t t = now_ns();
            if (!since) { since = t; continue; }
            if (t - since < SPIN_NS) continue;
            atomic_fetch_add(&pool.sleepers, 1);  /* then the job's check below (see par_for) */
            pthread_mutex_lock(&pool.sleep_lock);
            while (atomic_load(&pool.job) >> 8 == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            pthread_mutex_unlock(&pool.sleep_lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            since = 0;
        }
        seen = job >> 8;
        const int nth = (int)(job & 0xFF);
        if (ith < nth) {
            run_share(ith, nth);
            atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
        }
    }
    return NULL;
}

static int pool_start(int nth) {
    if (pool.pid != getpid()) {  /* first use, or a forked child: it has none of the workers, and the sleep lock
                                    and condition may hold state of the parent's sleeping ones */
        pool.started = 0, pool.pid = getpid();
        pthread_mutex_init(&pool.sleep_lock, NULL);
        pthread_cond_init(&pool.wake, NULL);
        atomic_store(&pool.sleepers, 0);
    }
    while (pool.started < nth - 1) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t t;
        pool_first_job[pool.started + 1] = atomic_load(&pool.job);
        const int rc = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attr);
        if (rc) break;
        pool.started++;
    }
    return pool.started + 1 < nth ? pool.started + 1 : nth;
}

static void par_for(int64_t n, body_fn body, const void *ctx, int nth, int interleave) {
    if (nth > MAX_THREADS) nth = MAX_THREADS;
    if (nth > n) nth = (int)n;
    if (nth <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t i = 0; i < n; i++) body(ctx, i);
        return;
    }
    nth = pool_start(nth);
    pool.fn = body, pool.ctx = ctx, pool.n = n, pool.interleave = interleave;
    atomic_store(&pool.pending, nth - 1);
    const uint64_t next = ((atomic_load(&pool.job) >> 8) + 1) << 8 | (uint64_t)nth;
    atomic_store(&pool.job, next);  /* seq_cst: a worker that saw no sleepers' wake-up sees this job */
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
    run_share(0, nth);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) _mm_pause();
    pthread_mutex_unlock(&pool.busy);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the four horizontal sums of a0 .. a3 at once: hadd pairs, then fold the 128-bit halves */
static inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* sum of a[i] * b[i] over n floats, eight lanes then the tail */
static inline float dot_n(const float *a, const float *b, int64_t n) {
    __m256 t8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) t8 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), t8);
    float t = hsum8(t8);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
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

/* sx[i] = dx[i] * sum(xq of block i), for n blocks: what a weight's per-block offset multiplies */
static void block_sums(const int8_t *xq, const float *dx, float *sx, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int t = 0;
        for (int j = 0; j < QK; j++) t += xq[i * QK + j];
        sx[i] = (float)t * dx[i];
    }
}

#define MAX_ROWS 128

/* Which kernels the several-row GEMVs use: AVX2 everywhere, AVX-512 VNNI where the CPU and the OS have it
   (sgnb_set_isa, called once by the Python side: it asks, the CPU decides). */
enum { ISA_AVX2 = 0, ISA_AVX512_VNNI = 1 };
static int isa = ISA_AVX2;

int sgnb_set_isa(int level) {
    __builtin_cpu_init();
    const int have = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                     __builtin_cpu_supports("avx512vnni");
    isa = (level >= ISA_AVX512_VNNI && have) ? ISA_AVX512_VNNI : ISA_AVX2;
    return isa;
}

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* Four Q8_0 columns n .. n + 3 against R <= 4 rows with AVX-512 VNNI. vpdpbusd multiplies unsigned by signed
   bytes: the weights go in as w + 128 (w ^ 0x80), and 128 sum(x) per block comes off at the end (sx: each row
   block's dx sum(xq)). Lanes 0-7 / 8-15 of a product are the first / second column of a pair. */
static inline __attribute__((always_inline)) AVX512_VNNI void q8_tile_vnni(
        const int8_t *wq, const float *wd, const int8_t *xq, const float *dx, const float *sx, float *y, int64_t n,
        int64_t r0, const int R, int64_t K, int64_t N) {
    const int64_t G = K / QK;
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc0[4], acc1[4];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *w = wq + n * K + g * QK;
        const __m512i a = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(
            _mm256_loadu_si256((const __m256i *)w)), _mm256_loadu_si256((const __m256i *)(w + K)), 1), flip);
        const __m512i b = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(
            _mm256_loadu_si256((const __m256i *)(w + 2 * K))), _mm256_loadu_si256((const __m256i *)(w + 3 * K)), 1), flip);
        const __m512 sa = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(wd[n * G + g])),
                                             _mm256_set1_ps(wd[(n + 1) * G + g]), 1);
        const __m512 sb = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(wd[(n + 2) * G + g])),
                                             _mm256_set1_ps(wd[(n + 3) * G + g]), 1);
        for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + (r0 + r) * K + g * QK)));
            const __m512 dr = _mm512_set1_ps(dx[(r0 + r) * G + g]);
            acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, a, xv)), _mm512_mul_ps(sa, dr), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, b, xv)), _mm512_mul_ps(sb, dr), acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 h[4] = {_mm512_castps512_ps256(acc0[r]), _mm512_extractf32x8_ps(acc0[r], 1),
                             _mm512_castps512_ps256(acc1[r]), _mm512_extractf32x8_ps(acc1[r], 1)};
        const float *sr = sx + (r0 + r) * G;
        for (int c = 0; c < 4; c++) y[(r0 + r) * N + n + c] = hsum8(h[c]) - 128.0f * dot_n(wd + (n + c) * G, sr, G);
    }
}

static void AVX512_VNNI q8_tile_rows_vnni(const int8_t *wq, const float *wd, const int8_t *xq, const float *dx,
                                          const float *sx, float *y, int64_t n, int64_t r0, int R, int64_t K,
                                          int64_t N) {
    switch (R) {  /* a constant R for each inlined copy: its loops unroll */
    case 4: q8_tile_vnni(wq, wd, xq, dx, sx, y, n, r0, 4, K, N); break;
    case 3: q8_tile_vnni(wq, wd, xq, dx, sx, y, n, r0, 3, K, N); break;
    case 2: q8_tile_vnni(wq, wd, xq, dx, sx, y, n, r0, 2, K, N); break;
    default: q8_tile_vnni(wq, wd, xq, dx, sx, y, n, r0, 1, K, N); break;
    }
}

/* y[r][n], y[r][n + 1] for rows r0 .. r0 + R - 1 of a Q8_0 weight (see sgnb_q8_gemv) */
static inline __attribute__((always_inline)) void q8_two_columns(const int8_t *wq, const float *wd, const int8_t *xq,
                                                                 const float *dx, float *y, int64_t n, int64_t r0,
                                                                 const int R, int64_t K, int64_t N) {
    const int64_t G = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *w0 = wq + n * K, *w1 = w0 + K;
    const float *d0 = wd + n * G, *d1 = d0 + G;
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(w0 + g * QK));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w1 + g * QK));
        const __m256i ua = _mm256_sign_epi8(a, a), ub = _mm256_sign_epi8(b, b);  /* |w|; w's sign moves to x */
        const __m256 da = _mm256_set1_ps(d0[g]), db = _mm256_set1_ps(d1[g]);
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (r0 + r) * K + g * QK));
            const __m256 dr = _mm256_set1_ps(dx[(r0 + r) * G + g]);
            const __m256i pa = _mm256_madd_epi16(_mm256_maddubs_epi16(ua, _mm256_sign_epi8(xv, a)), ones);
            const __m256i pb = _mm256_madd_epi16(_mm256_maddubs_epi16(ub, _mm256_sign_epi8(xv, b)), ones);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pa), _mm256_mul_ps(da, dr), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pb), _mm256_mul_ps(db, dr), acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        y[(r0 + r) * N + n] = hsum8(acc0[r]);
        y[(r0 + r) * N + n + 1] = hsum8(acc1[r]);
    }
}

struct q8_job {
    const int8_t *wq, *xq;
    const float *wd, *dx, *sx;
    float *y;
    int64_t M, K, N, first_col;
};

static void q8_vnni_tile(const void *p, int64_t i) {  /* columns 4i .. 4i + 3, every row */
    const struct q8_job *j = p;
    for (int64_t r0 = 0; r0 < j->M; r0 += 4)
        q8_tile_rows_vnni(j->wq, j->wd, j->xq, j->dx, j->sx, j->y, 4 * i, r0, j->M - r0 < 4 ? (int)(j->M - r0) : 4,
                          j->K, j->N);
}

static void q8_pair(const void *p, int64_t i) {  /* columns 2i, 2i + 1, every row */
    const struct q8_job *j = p;
    for (int64_t r0 = 0; r0 < j->M; r0 += 4) {
        const int R = j->M - r0 < 4 ? (int)(j->M - r0) : 4;
        switch (R) {  /* a constant R for each inlined copy: its loops unroll */
        case 4: q8_two_columns(j->wq, j->wd, j->xq, j->dx, j->y, 2 * i, r0, 4, j->K, j->N); break;
        case 3: q8_two_columns(j->wq, j->wd, j->xq, j->dx, j->y, 2 * i, r0, 3, j->K, j->N); break;
        case 2: q8_two_columns(j->wq, j->wd, j->xq, j->dx, j->y, 2 * i, r0, 2, j->K, j->N); break;
        default: q8_two_columns(j->wq, j->wd, j->xq, j->dx, j->y, 2 * i, r0, 1, j->K, j->N); break;
        }
    }
}

/* one row: the four columns 4i .. 4i + 3 (adjacent in memory) share each block of xq, four accumulators */
static void q8_row_tile(const void *p, int64_t i) {
    const struct q8_job *j = p;
    const int64_t n = 4 * i, K = j->K, G = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *w = j->wq + n * K;
    const float *d = j->wd + n * G, *dx = j->dx;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < G; g++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(j->xq + g * QK));
#define Q8_STEP(A, C)                                                                                        \
        {                                                                                                   \
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + C * K + g * QK));                    \
            const __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv),             \
                                                                      _mm256_sign_epi8(xv, wv)), ones);      \
            A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pr), _mm256_set1_ps(d[C * G + g] * dx[g]), A);            \
        }
        Q8_STEP(a0, 0) Q8_STEP(a1, 1) Q8_STEP(a2, 2) Q8_STEP(a3, 3)
#undef Q8_STEP
    }
    _mm_storeu_ps(j->y + n, hsum8x4(a0, a1, a2, a3));
}

static void q8_column(const void *p, int64_t i) {  /* column first_col + i on its own, every row */
    const struct q8_job *j = p;
    const int64_t n = j->first_col + i, M = j->M, K = j->K, G = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *wr = j->wq + n * K;
    const float *dr = j->wd + n * G;
    for (int64_t g = 0; g < G; g++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + g * QK));
        const __m256i aw = _mm256_sign_epi8(w, w);  /* |w| as the unsigned operand, w's sign moved to x */
        const float d = dr[g];
        for (int64_t r = 0; r < M; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(j->xq + r * K + g * QK));
            const __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pr), _mm256_set1_ps(d * j->dx[r * G + g]), acc[r]);
        }
    }
    for (int64_t r = 0; r < M; r++) j->y[r * j->N + n] = hsum8(acc[r]);
}

int sgnb_q8_gemv(const int8_t *wq, const float *wd, const float *x, float *y, int64_t M, int64_t K, int64_t N,
                 int nthreads) {
    if (M > MAX_ROWS || K % QK) return 1;
    const int64_t G = K / QK;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *dx = malloc(sizeof(float) * (size_t)(M * G));
    if (!xq || !dx) { free(xq); free(dx); return 2; }
    quantize_rows(x, M, K, xq, dx);
    struct q8_job job = {wq, xq, wd, dx, NULL, y, M, K, N, 0};
    if (M > 1 && isa == ISA_AVX512_VNNI && N >= 4) {
        float *sx = malloc(sizeof(float) * (size_t)(M * G));
        if (!sx) { free(xq); free(dx); return 2; }
        block_sums(xq, dx, sx, M * G);
        job.sx = sx;
        par_for(N / 4, q8_vnni_tile, &job, nthreads, 0);
        free(sx);
        job.first_col = N / 4 * 4;
    } else if (M > 1) {
        /* several rows: two columns against up to four rows at a time, each weight block loaded once for the
           rows and each row's block once for both columns, the accumulators in registers */
        par_for(N / 2, q8_pair, &job, nthreads, 0);
        job.first_col = N / 2 * 2;
    } else {
        par_for(N / 4, q8_row_tile, &job, nthreads, 0);
        job.first_col = N / 4 * 4;
    }
    par_for(N - job.first_col, q8_column, &job, nthreads, 0);
    free(xq); free(dx);
    return 0;
}

/* GEMV with 4-bit weights: W (N, K) in blocks of 32 along K, w = q * d + m with q in [0, 15] and d, m float16
   per block (a Q4_0 / Q4_1 GGUF weight, such as the default model's linears). A block's 32 codes take 16 bytes:
   byte j holds q[j] in its low nibble and q[j + 16] in its high one, so the two halves unpack with a mask and a
   shift into the order of x. Rows of x are rounded to int8 per block as above (x ~ xq * dx), and
   sum(w * x) = d dx sum(q xq) + m dx sum(xq): unsigned codes times signed activations is exactly what
   maddubs multiplies. One row (a decode step) takes four columns at a time, two blocks per 32-byte load;
   several rows share each unpacked block instead, two accumulators per row.

   Layout: columns go in tiles of four (the last N % 4 columns as they are, one after another). A tile holds
   its four columns' blocks pair by pair, [pair 0 of columns 0..3][pair 1 of columns 0..3]..., 32 bytes per
   column and pair, then (odd K / 32) the last block of each column, 16 bytes each: the one-row kernel then
   reads memory strictly in order, prefetched ahead. The columns one after another, each a stream of its own,
   ran at ~13 GB/s of this machine's 23; in order and prefetched, a microbenchmark of the default model's 120
   layers went from 4.5 to 2.8 ms. */

#define Q4_PREFETCH 2048 /* bytes ahead of the one-row kernel's reads */

#define MAX_BLOCKS 1024 /* K up to 32768 */

static inline void halfs_to_floats(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
}

/* Several rows (M > 1): two columns of a tile against R <= 4 rows at a time, each pair of blocks unpacked once
   for the R rows and each row's activations loaded once for both columns, the 2 x R accumulators in registers.
   xp holds each row's activations in the tiles' pair order (as the one-row kernel's), dxp each row's pair
   scales [dx_g x4, dx_g+1 x4]; d0 / d1 the two columns' block scales as floats. out[c][r]: the q terms' sums. */
static inline __attribute__((always_inline)) void q4_two_columns(const uint8_t *tile, int64_t c0, int64_t G,
                                                                 const float *d0, const float *d1, const int8_t *xp,
                                                                 const float *dxp, const int8_t *xq, const float *dx,
                                                                 int64_t r0, const int R, int64_t K,
                                                                 float out[2][4]) {
    const __m256i ones = _mm256_set1_epi16(1), low8 = _mm256_set1_epi8(0x0F);
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t P = G / 2;
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(tile + p * 128 + c0 * 32));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(tile + p * 128 + c0 * 32 + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low8), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low8);
        const __m256i lo1 = _mm256_and_si256(v1, low8), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low8);
        const __m256 s0 = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(d0 + 2 * p)))), spread);
        const __m256 s1 = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(d1 + 2 * p)))), spread);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xp + (r0 + r) * K + p * 64;
            const __m256i xa = _mm256_load_si256((const __m256i *)xr), xb = _mm256_load_si256((const __m256i *)(xr + 32));
            const __m256 dr = _mm256_load_ps(dxp + ((r0 + r) * P + p) * 8);
            const __m256i p0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa),
                                                                  _mm256_maddubs_epi16(hi0, xb)), ones);
            const __m256i p1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa),
                                                                  _mm256_maddubs_epi16(hi1, xb)), ones);
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(s0, dr), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(s1, dr), acc1[r]);
        }
    }
    if (G % 2) {  /* the odd last block: 16 bytes per column after the pairs, codes in x's order */
        const int64_t g = G - 1;
        const __m128i v0 = _mm_loadu_si128((const __m128i *)(tile + g * 64 + c0 * 16));
        const __m128i v1 = _mm_loadu_si128((const __m128i *)(tile + g * 64 + c0 * 16 + 16));
        const __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v0, 4), low), _mm_and_si128(v0, low));
        const __m256i q1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v1, 4), low), _mm_and_si128(v1, low));
        for (int r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (r0 + r) * K + g * QK));
            const float dr = dx[(r0 + r) * G + g];
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q0, xv), ones)),
                                      _mm256_set1_ps(d0[g] * dr), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q1, xv), ones)),
                                      _mm256_set1_ps(d1[g] * dr), acc1[r]);
        }
    }
    for (int r = 0; r < R; r++) { out[0][r] = hsum8(acc0[r]); out[1][r] = hsum8(acc1[r]); }
}

/* A whole tile (four columns) against R <= 4 rows with AVX-512 VNNI: one 64-byte load holds a pair of blocks of
   two columns, vpdpbusd multiplies its codes by the row's activations (broadcast to both halves) and sums in
   int32 (no int16 step); lanes 0-3 / 4-7 / 8-11 / 12-15 are block g and g + 1 of the first column, then of the
   second. out[c][r] as q4_two_columns'. */

static inline __attribute__((always_inline)) AVX512_VNNI void q4_tile_vnni(
        const uint8_t *tile, int64_t G, float d[4][MAX_BLOCKS], const int8_t *xp, const float *dxp,
        const int8_t *xq, const float *dx, int64_t r0, const int R, int64_t K, float out[4][4]) {
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    /* [d0_g x4, d0_g+1 x4, d1_g x4, d1_g+1 x4] from the pair's (d0_g, d0_g+1, d1_g, d1_g+1) */
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t P = G / 2;
    __m512 acc0[4], acc1[4];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        const __m512i v0 = _mm512_loadu_si512((const void *)(tile + p * 128));
        const __m512i v1 = _mm512_loadu_si512((const void *)(tile + p * 128 + 64));
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        const __m128 e0 = _mm_setr_ps(d[0][2 * p], d[0][2 * p + 1], d[1][2 * p], d[1][2 * p + 1]);
        const __m128 e1 = _mm_setr_ps(d[2][2 * p], d[2][2 * p + 1], d[3][2 * p], d[3][2 * p + 1]);
        const __m512 s0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(e0));
        const __m512 s1 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(e1));
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xp + (r0 + r) * K + p * 64;
            const __m512i xa = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)xr));
            const __m512i xb = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(xr + 32)));
            const __m512 dr = _mm512_broadcast_f32x8(_mm256_load_ps(dxp + ((r0 + r) * P + p) * 8));
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo0, xa), hi0, xb);
            const __m512i p1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo1, xa), hi1, xb);
            acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(s0, dr), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(s1, dr), acc1[r]);
        }
    }
    float tail[4][4] = {{0}};
    if (G % 2) {  /* the odd last block: the tile's four columns' 16 bytes, one 64-byte load; codes in x's order */
        const int64_t g = G - 1;
        const __m512i v = _mm512_loadu_si512((const void *)(tile + g * 64));
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (r0 + r) * K + g * QK;
            const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xr));
            const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xr + 16)));
            int32_t lanes[16];
            _mm512_storeu_si512((void *)lanes, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xl), hi, xh));
            const float dr = dx[(r0 + r) * G + g];
            for (int c = 0; c < 4; c++)
                tail[c][r] = (float)(lanes[4 * c] + lanes[4 * c + 1] + lanes[4 * c + 2] + lanes[4 * c + 3]) * d[c][g] * dr;
        }
    }
    for (int r = 0; r < R; r++) {
        const __m256 a0 = _mm512_castps512_ps256(acc0[r]), a1 = _mm512_extractf32x8_ps(acc0[r], 1);
        const __m256 b0 = _mm512_castps512_ps256(acc1[r]), b1 = _mm512_extractf32x8_ps(acc1[r], 1);
        out[0][r] = hsum8(a0) + tail[0][r];
        out[1][r] = hsum8(a1) + tail[1][r];
        out[2][r] = hsum8(b0) + tail[2][r];
        out[3][r] = hsum8(b1) + tail[3][r];
    }
}

static void AVX512_VNNI q4_tile_rows_vnni(const uint8_t *tile, int64_t G, float d[4][MAX_BLOCKS], const int8_t *xp,
                                          const float *dxp, const int8_t *xq, const float *dx, int64_t r0, int R,
                                          int64_t K, float out[4][4]) {
    switch (R) {  /* a constant R for each inlined copy: its loops unroll */
    case 4: q4_tile_vnni(tile, G, d, xp, dxp, xq, dx, r0, 4, K, out); break;
    case 3: q4_tile_vnni(tile, G, d, xp, dxp, xq, dx, r0, 3, K, out); break;
    case 2: q4_tile_vnni(tile, G, d, xp, dxp, xq, dx, r0, 2, K, out); break;
    default: q4_tile_vnni(tile, G, d, xp, dxp, xq, dx, r0, 1, K, out); break;
    }
}

struct q4_job {
    const uint8_t *wq;
    const uint16_t *wd, *wm;
    const int8_t *xq, *xp;  /* xp: the one-row path's pairs of blocks, or the rows' pairs (several rows) */
    const float *dx, *sx, *dxp;
    float *y;
    int64_t M, K, N, first_col;
};

/* one row: the four columns 4i .. 4i + 3 share each block of xq, four accumulators in flight, one reduction */
static void q4_row_tile(const void *p, int64_t i) {
    const struct q4_job *j = p;
    const int64_t n = 4 * i, K = j->K, G = K / QK;
    const uint16_t *wd = j->wd, *wm = j->wm;
    const float *dx = j->dx, *sx = j->sx;
    const int8_t *xp = j->xp, *xq = j->xq;
    const __m256i ones = _mm256_set1_epi16(1), low8 = _mm256_set1_epi8(0x0F);
    const __m128i low = _mm_set1_epi8(0x0F);
    float ds[4][MAX_BLOCKS];
    float mt[4];
    for (int c = 0; c < 4; c++) {  /* the blocks' d * dx, and the m terms' sum */
        const uint16_t *dh = wd + (n + c) * G, *mh = wm + (n + c) * G;
        __m256 t8 = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= G; g += 8) {
            _mm256_storeu_ps(ds[c] + g, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + g))),
                                                      _mm256_loadu_ps(dx + g)));
            t8 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mh + g))),
                                 _mm256_loadu_ps(sx + g), t8);
        }
        float t = hsum8(t8);
        for (; g < G; g++) { ds[c][g] = _cvtsh_ss(dh[g]) * dx[g]; t += _cvtsh_ss(mh[g]) * sx[g]; }
        mt[c] = t;
    }
    const uint8_t *tile = j->wq + n * G * 16;  /* four columns' blocks, pair by pair */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    int64_t g = 0;
    /* two blocks per 32-byte load: its low nibbles are codes 0-15 of both, the high ones codes 16-31, matched by
       xp's order; the int32 lanes 0-3 then sum block g, lanes 4-7 block g + 1 */
    for (; g + 2 <= G; g += 2) {
        _mm_prefetch((const char *)(tile + g * 64 + Q4_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(tile + g * 64 + 64 + Q4_PREFETCH), _MM_HINT_T0);
        const __m256i xa = _mm256_loadu_si256((const __m256i *)(xp + g * QK));
        const __m256i xb = _mm256_loadu_si256((const __m256i *)(xp + g * QK + 32));
#define Q4_PAIR(A, C)                                                                                        \
        {                                                                                                   \
            const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + g * 64 + C * 32));                 \
            const __m256i lo = _mm256_and_si256(v, low8), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low8); \
            const __m256i p = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa),                 \
                                                                 _mm256_maddubs_epi16(hi, xb)), ones);          \
            const __m256 sc = _mm256_permutevar8x32_ps(                                                     \
                _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&ds[C][g]))), spread); \
            A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, A);                                               \
        }
        Q4_PAIR(a0, 0) Q4_PAIR(a1, 1) Q4_PAIR(a2, 2) Q4_PAIR(a3, 3)
#undef Q4_PAIR
    }
    for (; g < G; g++) {  /* an odd last block: 16 bytes per column after the pairs */
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + g * QK));
#define Q4_STEP(A, C)                                                                                        \
        {                                                                                                   \
            const __m128i v = _mm_loadu_si128((const __m128i *)(tile + g * 64 + C * 16));                    \
            const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low)); \
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);                          \
            A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&ds[C][g]), A);                   \
        }
        Q4_STEP(a0, 0) Q4_STEP(a1, 1) Q4_STEP(a2, 2) Q4_STEP(a3, 3)
#undef Q4_STEP
    }
    _mm_storeu_ps(j->y + n, _mm_add_ps(hsum8x4(a0, a1, a2, a3), _mm_loadu_ps(mt)));
}

/* several rows: the tile of columns 4i .. 4i + 3 against up to four rows at a time */
static void q4_rows_tile(const void *p, int64_t i) {
    const struct q4_job *j = p;
    const int64_t n = 4 * i, M = j->M, K = j->K, N = j->N, G = K / QK;
    float d[4][MAX_BLOCKS], m[4][MAX_BLOCKS];
    for (int c = 0; c < 4; c++) { halfs_to_floats(j->wd + (n + c) * G, d[c], G); halfs_to_floats(j->wm + (n + c) * G, m[c], G); }
    const uint8_t *tile = j->wq + n * G * 16;
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        float out[4][4];
        const int R = M - r0 < 4 ? (int)(M - r0) : 4;
        if (isa == ISA_AVX512_VNNI) {
            q4_tile_rows_vnni(tile, G, d, j->xp, j->dxp, j->xq, j->dx, r0, R, K, out);
        } else {
            for (int64_t c0 = 0; c0 < 4; c0 += 2) {
                float half[2][4];
                switch (R) {  /* a constant R for each copy of the inlined kernel: its loops unroll */
                case 4: q4_two_columns(tile, c0, G, d[c0], d[c0 + 1], j->xp, j->dxp, j->xq, j->dx, r0, 4, K, half); break;
                case 3: q4_two_columns(tile, c0, G, d[c0], d[c0 + 1], j->xp, j->dxp, j->xq, j->dx, r0, 3, K, half); break;
                case 2: q4_two_columns(tile, c0, G, d[c0], d[c0 + 1], j->xp, j->dxp, j->xq, j->dx, r0, 2, K, half); break;
                default: q4_two_columns(tile, c0, G, d[c0], d[c0 + 1], j->xp, j->dxp, j->xq, j->dx, r0, 1, K, half); break;
                }
                for (int r = 0; r < R; r++) { out[c0][r] = half[0][r]; out[c0 + 1][r] = half[1][r]; }
            }
        }
        for (int c = 0; c < 4; c++)
            for (int r = 0; r < R; r++)  /* + the m terms: sum over blocks of m dx sum(xq) */
                j->y[(r0 + r) * N + n + c] = out[c][r] + dot_n(m[c], j->sx + (r0 + r) * G, G);
    }
}

/* column first_col + i on its own (the tiles' last N % 4 columns), every row: blocks g, g + 1 (g even) at
   wr + g / 2 * 32, the odd last one at `last` */
static void q4_column(const void *p, int64_t i) {
    const struct q4_job *j = p;
    const int64_t n = j->first_col + i, M = j->M, K = j->K, G = K / QK;
    const int8_t *xq = j->xq;
    const float *dx = j->dx;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i low = _mm_set1_epi8(0x0F);
    float d[MAX_BLOCKS], m[MAX_BLOCKS];
    halfs_to_floats(j->wd + n * G, d, G);
    halfs_to_floats(j->wm + n * G, m, G);
    const uint8_t *wr = j->wq + n * G * (QK / 2);
    const int64_t pair_stride = 32;
    const uint8_t *last = j->wq + n * G * 16 + (G - 1) * 16;
    __m256 acc[MAX_ROWS], acc2[MAX_ROWS];
    for (int64_t r = 0; r < M; r++) acc[r] = acc2[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
        const __m128i v0 = _mm_loadu_si128((const __m128i *)(wr + g / 2 * pair_stride));
        const __m128i v1 = _mm_loadu_si128((const __m128i *)(wr + g / 2 * pair_stride + 16));
        const __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v0, 4), low), _mm_and_si128(v0, low));
        const __m256i q1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v1, 4), low), _mm_and_si128(v1, low));
        for (int64_t r = 0; r < M; r++) {
            const int8_t *xr = xq + r * K + g * QK;
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)xr)), ones);
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, _mm256_loadu_si256((const __m256i *)(xr + QK))), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d[g] * dx[r * G + g]), acc[r]);
            acc2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d[g + 1] * dx[r * G + g + 1]), acc2[r]);
        }
    }
    for (; g < G; g++) {  /* the odd last block */
        const __m128i v0 = _mm_loadu_si128((const __m128i *)last);
        const __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v0, 4), low), _mm_and_si128(v0, low));
        for (int64_t r = 0; r < M; r++) {
            const __m256i p0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)(xq + r * K + g * QK))), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d[g] * dx[r * G + g]), acc[r]);
        }
    }
    for (int64_t r = 0; r < M; r++) {
        const float *sr = j->sx + r * G;
        __m256 macc = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= G; k += 8) macc = _mm256_fmadd_ps(_mm256_loadu_ps(m + k), _mm256_loadu_ps(sr + k), macc);
        float tail = 0.0f;
        for (; k < G; k++) tail += m[k] * sr[k];
        j->y[r * j->N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r], acc2[r]), macc)) + tail;
    }
}

int sgnb_q4_gemv(const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, const float *x, float *y, int64_t M,
                 int64_t K, int64_t N, int nthreads) {
    if (M > MAX_ROWS || K % QK || K / QK > MAX_BLOCKS) return 1;
    const int64_t G = K / QK;
    int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    float *dx = malloc(sizeof(float) * (size_t)(M * G)), *sx = malloc(sizeof(float) * (size_t)(M * G));
    if (!xq || !dx || !sx) { free(xq); free(dx); free(sx); return 2; }
    quantize_rows(x, M, K, xq, dx);
    block_sums(xq, dx, sx, M * G);
    struct q4_job job = {wq, wd, wm, xq, NULL, dx, sx, NULL, y, M, K, N, 0};
    if (M == 1) {
        int8_t *xp = aligned_alloc(64, (size_t)((K + 63) / 64 * 64));
        if (!xp) { free(xq); free(dx); free(sx); return 2; }
        for (int64_t g = 0; g + 2 <= G; g += 2)  /* pairs of blocks: [a0-15 b0-15] [a16-31 b16-31] */
            for (int k = 0; k < 16; k++) {
                xp[g * QK + k] = xq[g * QK + k];
                xp[g * QK + 16 + k] = xq[(g + 1) * QK + k];
                xp[g * QK + 32 + k] = xq[g * QK + 16 + k];
                xp[g * QK + 48 + k] = xq[(g + 1) * QK + 16 + k];
            }
        job.xp = xp;
        par_for(N / 4, q4_row_tile, &job, nthreads, 0);
        free(xp);
        job.first_col = N / 4 * 4;
    } else if (N >= 4) {
        const int64_t P = G / 2;
        int8_t *xp = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
        float *dxp = aligned_alloc(64, sizeof(float) * (size_t)((M * P * 8 + 15) / 16 * 16 + 16));
        if (!xp || !dxp) { free(xp); free(dxp); free(xq); free(dx); free(sx); return 2; }
        for (int64_t r = 0; r < M; r++)
            for (int64_t p = 0; p < P; p++) {
                const int8_t *a = xq + r * K + 2 * p * QK, *b = a + QK;
                int8_t *o = xp + r * K + p * 64;
                for (int k = 0; k < 16; k++) { o[k] = a[k]; o[16 + k] = b[k]; o[32 + k] = a[16 + k]; o[48 + k] = b[16 + k]; }
                for (int k = 0; k < 4; k++) { dxp[(r * P + p) * 8 + k] = dx[r * G + 2 * p]; dxp[(r * P + p) * 8 + 4 + k] = dx[r * G + 2 * p + 1]; }
            }
        job.xp = xp, job.dxp = dxp;
        par_for(N / 4, q4_rows_tile, &job, nthreads, 0);
        free(xp); free(dxp);
        job.first_col = N / 4 * 4;
    }
    par_for(N - job.first_col, q4_column, &job, nthreads, 0);
    free(xq); free(dx); free(sx);
    return 0;
}

/* GEMV with float32 weights: y (M, N) = x (M, K) @ W^T, W (N, K) row-major as torch keeps an nn.Linear's (the
   exact engine's layers, `quantization="none"`). torch's GEMM ran the default model's layers at 6 rows in 2.1x
   its time at one row on the 2-core EPYC (15 GFLOP/s: its small-M path), where the bytes read are the same.
   Here four columns go against two rows at a time, the eight accumulators in registers: each weight vector
   loaded once serves both rows, and the tile (4 x K floats) stays in L1 / L2 for the next pair of rows, so
   the weights stream from memory once per call whatever M is.

   Every output is one accumulator of eight lanes over K in order, then the same horizontal sum, whichever rows
   sit beside it: a row's result does not depend on M or on the other rows (a request's logits do not change
   with the batch it decodes in). K must be a multiple of 8. */

/* floats ahead of the first pair of rows' weight reads: 8 KB, about the next tile's weights, so the four
   columns' rows (adjacent in memory) read as one stream. The default model's layers and head at 1 / 2 / 8 / 16
   rows on the 2-core EPYC, one thread (2026-12-07): 46 / 47 / 88 / 110 ms against torch's 53 / 110 / 129 /
   138; no prefetch: 53 / 66 / 106 / 119 ms */
#define F32_PREFETCH 2048

struct f32_job { const float *w, *x; float *y; int64_t M, K, N, first_col; };

static void f32_tile(const void *p, int64_t i) {  /* columns 4i .. 4i + 3, every row */
    const struct f32_job *j = p;
    const int64_t K = j->K, N = j->N, n = 4 * i;
    const float *w0 = j->w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    for (int64_t r = 0; r < j->M; r += 2) {
        const int two = r + 1 < j->M;
        const float *x0 = j->x + r * K, *x1 = two ? x0 + K : x0;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
        for (int64_t k = 0; k < K; k += 8) {
            if (r == 0 && (k & 15) == 0) {
                _mm_prefetch((const char *)(w0 + k + F32_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(w1 + k + F32_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(w2 + k + F32_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(w3 + k + F32_PREFETCH), _MM_HINT_T0);
            }
            const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
            const __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
            const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
            a00 = _mm256_fmadd_ps(v0, xa, a00); a01 = _mm256_fmadd_ps(v1, xa, a01);
            a02 = _mm256_fmadd_ps(v2, xa, a02); a03 = _mm256_fmadd_ps(v3, xa, a03);
            a10 = _mm256_fmadd_ps(v0, xb, a10); a11 = _mm256_fmadd_ps(v1, xb, a11);
            a12 = _mm256_fmadd_ps(v2, xb, a12); a13 = _mm256_fmadd_ps(v3, xb, a13);
        }
        _mm_storeu_ps(j->y + r * N + n, hsum8x4(a00, a01, a02, a03));
        if (two) _mm_storeu_ps(j->y + (r + 1) * N + n, hsum8x4(a10, a11, a12, a13));
    }
}

static void f32_column(const void *p, int64_t i) {  /* column first_col + i on its own, every row */
    const struct f32_job *j = p;
    const int64_t n = j->first_col + i;
    for (int64_t r = 0; r < j->M; r++) j->y[r * j->N + n] = dot_n(j->w + n * j->K, j->x + r * j->K, j->K);
}

int sgnb_f32_gemv(const float *w, const float *x, float *y, int64_t M, int64_t K, int64_t N, int nthreads) {
    if (M < 1 || K % 8) return 1;
    struct f32_job job = {w, x, y, M, K, N, N / 4 * 4};
    par_for(N / 4, f32_tile, &job, nthreads, 0);
    par_for(N - job.first_col, f32_column, &job, nthreads, 0);
    return 0;
}

/* ---- float32 products over exactly compact weights: w = q * d + m per block of 32 ------------------------

   The exact engine's linears whose float32 weights are, bit for bit, int8 codes q (N, K) with a float32 d and m
   per block of 32 along K (weights converted from a Q4_0 / Q4_1 / Q8_0 GGUF: kernels/dense_linear.py): each
   weight rebuilt in float32 by one fma (the same float as the weight: the caller checked), then float32 products
   as sgnb_f32_gemv's, reading 1 byte a weight instead of 4. A column's every row is computed alike (two
   accumulators a row, blocks in order), so each row's result depends only on that row, and threads split
   columns. */

struct qf32_job { const int8_t *q; const float *d, *m, *x; float *y; int64_t M, K, N; };

/* columns n .. n + C - 1 against rows r0 .. r0 + R - 1 (C, R constants once inlined: the accumulators live in
   registers); each (row, column) pair is computed the same way whatever C and R are */
static inline __attribute__((always_inline)) void qf32_tile(const struct qf32_job *j, int64_t n, int64_t r0,
                                                             const int C, const int R) {
    const int64_t K = j->K, G = K / QK;
    __m256 a[2][4], b[2][4];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) a[c][r] = b[c][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) {
            const int8_t *qb = j->q + (n + c) * K + g * QK;
            const __m256 dv = _mm256_set1_ps(j->d[(n + c) * G + g]), mv = _mm256_set1_ps(j->m[(n + c) * G + g]);
            __m256 w[4];
            for (int i = 0; i < 4; i++)
                w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(qb + 8 * i)))), dv, mv);
            for (int r = 0; r < R; r++) {
                const float *xr = j->x + (r0 + r) * K + g * QK;
                a[c][r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a[c][r]);
                b[c][r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), b[c][r]);
                a[c][r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a[c][r]);
                b[c][r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), b[c][r]);
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) j->y[(r0 + r) * j->N + n + c] = hsum8(_mm256_add_ps(a[c][r], b[c][r]));
}

static void qf32_pair(const void *p, int64_t i) {  /* columns 2i, 2i + 1 (the last alone when N is odd) */
    const struct qf32_job *j = p;
    const int64_t n = 2 * i;
    const int C = n + 1 < j->N ? 2 : 1;
    for (int64_t r0 = 0; r0 < j->M;) {
        const int64_t left = j->M - r0;
        if (C == 2 && left >= 2) { qf32_tile(j, n, r0, 2, 2); r0 += 2; }
        else if (C == 2) { qf32_tile(j, n, r0, 2, 1); r0 += 1; }
        else if (left >= 4) { qf32_tile(j, n, r0, 1, 4); r0 += 4; }
        else if (left >= 2) { qf32_tile(j, n, r0, 1, 2); r0 += 2; }
        else { qf32_tile(j, n, r0, 1, 1); r0 += 1; }
    }
}

int sgnb_qf32_gemv(const int8_t *q, const float *d, const float *m, const float *x, float *y, int64_t M, int64_t K,
                   int64_t N, int nthreads) {
    if (M < 1 || K % QK) return 1;
    struct qf32_job job = {q, d, m, x, y, M, K, N};
    par_for((N + 1) / 2, qf32_pair, &job, nthreads, 0);
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
#define SERIAL_WORK 4096 /* key-heads (keys x query heads, summed over the batch) below which one thread runs */

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

struct attn_job {
    const float *q, *k_buf, *v_buf;
    const int64_t *req_to_token, *rows, *starts, *lens, *first;
    int64_t row_stride, B, H, Hkv, D, G;
    float scale;
    float *pm, *pl, *pa, *out, *lse;
};

/* task t: one (request, KV head, chunk of CHUNK keys), its G query heads' softmax partials */
static void attn_chunk(const void *p, int64_t t) {
    const struct attn_job *j = p;
    const int64_t G = j->G, D = j->D, H = j->H, Hkv = j->Hkv;
    float sc[MAX_GROUP * CHUNK] __attribute__((aligned(32)));
    int64_t b = 0, lo = 0, hi = j->B;  /* the request whose tasks hold t: first[b] <= t < first[b + 1] */
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (j->first[mid + 1] <= t) lo = mid + 1; else hi = mid;
    }
    b = lo;
    const int64_t len = j->lens[b], chunks = (len + CHUNK - 1) / CHUNK, local = t - j->first[b];
    const int64_t h = local / chunks, c = local % chunks;
    const int64_t i0 = c * CHUNK, n = (len - i0 < CHUNK) ? len - i0 : CHUNK;
    const int64_t *sl = j->req_to_token + j->rows[b] * j->row_stride + j->starts[b] + i0;
    const float *qh = j->q + (b * H + h * G) * D;
    for (int64_t i = 0; i < n; i++) {
        const float *kp = j->k_buf + (sl[i] * Hkv + h) * D;
        for (int64_t g = 0; g < G; g++) sc[g * CHUNK + i] = dot(qh + g * D, kp, D) * j->scale;
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
        float *acc = j->pa + (t * G + g) * D;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (i = 0; i < n; i++) {
            const float *vp = j->v_buf + (sl[i] * Hkv + h) * D;
            const __m256 pv = _mm256_set1_ps(s[i]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vp + d), _mm256_loadu_ps(acc + d)));
        }
        j->pm[t * G + g] = m;
        j->pl[t * G + g] = l;
    }
}

/* (request, query head) bh: its chunk partials merged */
static void attn_merge(const void *p, int64_t bh) {
    const struct attn_job *j = p;
    const int64_t G = j->G, D = j->D, H = j->H;
    const int64_t bb = bh / H, hh = bh % H, h = hh / G, g = hh % G;
    float *o = j->out + bh * D;
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    const int64_t chunks = (j->lens[bb] + CHUNK - 1) / CHUNK;
    if (chunks == 0) { j->lse[bh] = -INFINITY; return; }
    float M = -INFINITY, L = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float m = j->pm[(j->first[bb] + h * chunks + c) * G + g];
        M = m > M ? m : M;
    }
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t t = j->first[bb] + h * chunks + c;
        const float w = expf(j->pm[t * G + g] - M);
        L += w * j->pl[t * G + g];
        const float *acc = j->pa + (t * G + g) * D;
        for (int64_t d = 0; d < D; d++) o[d] += w * acc[d];
    }
    for (int64_t d = 0; d < D; d++) o[d] /= L;
    j->lse[bh] = M + logf(L);
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
    /* a short context is cheaper on one thread than splitting it (~38 us a layer at 128 keys x 9 heads on the
       2-core EPYC with OpenMP's wake-ups; our threads hand a job over in a few microseconds) */
    int64_t work = 0;
    for (int64_t b = 0; b < B; b++) work += lens[b] * H;
    const int nth = work > SERIAL_WORK ? nthreads : 1;
    const struct attn_job job = {q, k_buf, v_buf, req_to_token, rows, starts, lens, first, row_stride, B, H, Hkv, D,
                                 G, scale, pm, pl, pa, out, lse};
    par_for(T, attn_chunk, &job, nth, 1);  /* tasks of uneven size (a request's last chunk): interleaved */
    par_for(B * H, attn_merge, &job, nth, 0);
    free(first); free(pm); free(pl); free(pa);
    return 0;
}

/* ---- a whole decode forward of a Llama-family model ------------------------------------------------------

   B new tokens (B <= MAX_ROWS: one per request in a decode, or each token of a short extend) through every
   layer, with the layers' linears on the GEMVs
   above: the sequence the Python model runs (kernels/*, engine/models/llama.py) in one call, without the ~50
   torch ops and module calls per layer that cost a CPU decode step more than its arithmetic. Per layer:
   h = rmsnorm(x + residual); qkv = h Wqkv (+ bias); rotate q and k (rotate-half, the tables at each token's
   position); store k, v at the token's slot (every row's, before any attends); attention over the keys of
   the row's request up to its own (paged_decode: lens[b], so an extend's rows are causal); residual +=
   o_proj; h = rmsnorm(residual); x = down(silu(gate) * up). Then out = rmsnorm(x + residual) of the last layer.

   `table` holds one row of LAYER_FIELDS int64 per layer: pointers and the kind of each linear (4: q4, its
   wq / wd / wm; 8: q8, its wq / wd; 32: float32, its W (N, K); 33: float32 as exact codes, its q / d / m), as
   the LF_* indices say. x (B, hidden) holds the embeddings and gets the final hidden states. */

enum { LF_IN_NORM, LF_POST_NORM, LF_QKV, LF_QKV_BIAS = LF_QKV + 4, LF_O, LF_GATE_UP = LF_O + 4,
       LF_DOWN = LF_GATE_UP + 4, LF_K_BUF = LF_DOWN + 4, LF_V_BUF, LAYER_FIELDS };

static int linear(const int64_t *f, const float *x, float *y, int64_t M, int64_t K, int64_t N, int nthreads) {
    if (f[0] == 4) return sgnb_q4_gemv((const uint8_t *)f[1], (const uint16_t *)f[2], (const uint16_t *)f[3], x, y,
                                       M, K, N, nthreads);
    if (f[0] == 8) return sgnb_q8_gemv((const int8_t *)f[1], (const float *)f[2], x, y, M, K, N, nthreads);
    if (f[0] == 32) return sgnb_f32_gemv((const float *)f[1], x, y, M, K, N, nthreads);
    if (f[0] == 33) return sgnb_qf32_gemv((const int8_t *)f[1], (const float *)f[2], (const float *)f[3], x, y, M, K,
                                          N, nthreads);
    return 3;
}

/* y = x / rms(x) * w for each of M rows of n */
/* y = x / rms(x) * w for one row of n */
static inline void rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    __m256 ss = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { const __m256 v = _mm256_loadu_ps(x + i); ss = _mm256_fmadd_ps(v, v, ss); }
    float sum = hsum8(ss);
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static void rms_norm_rows(const float *x, const float *w, float *y, int64_t M, int64_t n, float eps) {
    for (int64_t r = 0; r < M; r++) rms_norm_row(x + r * n, w, y + r * n, n, eps);
}

/* a = silu(g) * u for one row of I */
static inline void silu_mul_row(const float *g, const float *u, float *a, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                              _mm256_loadu_ps(u + i)));
    }
    for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void rotate_half(float *x, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + h * D, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

int sgnb_decode_layers(const int64_t *table, int64_t L, int64_t B, float *x, const float *final_norm, float eps,
                       const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *out_loc,
                       const int64_t *req_to_token, int64_t row_stride, const int64_t *rows, const int64_t *lens,
                       int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t inter, float scale, int nthreads) {
    if (B > MAX_ROWS || B < 1 || D % 8 || hidden % QK || inter % QK || (H * D) % QK) return 1;
    const int64_t qs = H * D, kvs = Hkv * D, W = qs + 2 * kvs, half = D / 2;
    float *res = malloc(sizeof(float) * (size_t)(B * hidden)), *h = malloc(sizeof(float) * (size_t)(B * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(B * W)), *q = malloc(sizeof(float) * (size_t)(B * qs));
    float *att = malloc(sizeof(float) * (size_t)(B * qs)), *lse = malloc(sizeof(float) * (size_t)(B * H));
    float *gu = malloc(sizeof(float) * (size_t)(B * 2 * inter)), *act = malloc(sizeof(float) * (size_t)(B * inter));
    int64_t *starts = calloc((size_t)B, sizeof(int64_t));
    int rc = 0;
    if (!res || !h || !qkv || !q || !att || !lse || !gu || !act || !starts) { rc = 2; goto done; }
    for (int64_t i = 0; i < B * hidden; i++) res[i] = 0.0f;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *f = table + l * LAYER_FIELDS;
        for (int64_t i = 0; i < B * hidden; i++) res[i] += x[i];  /* x: the embeddings, then each MLP's output */
        rms_norm_rows(res, (const float *)f[LF_IN_NORM], h, B, hidden, eps);
        if ((rc = linear(f + LF_QKV, h, qkv, B, hidden, W, nthreads))) goto done;
        const float *bias = (const float *)f[LF_QKV_BIAS];
        float *k_buf = (float *)f[LF_K_BUF], *v_buf = (float *)f[LF_V_BUF];
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * W;
            if (bias) for (int64_t i = 0; i < W; i++) row[i] += bias[i];
            const float *c = cos_t + positions[b] * half, *sn = sin_t + positions[b] * half;
            rotate_half(row, H + Hkv, D, c, sn);  /* q's heads, then k's: adjacent in the row */
            for (int64_t i = 0; i < qs; i++) q[b * qs + i] = row[i];
            float *kd = k_buf + out_loc[b] * kvs, *vd = v_buf + out_loc[b] * kvs;
            for (int64_t i = 0; i < kvs; i++) { kd[i] = row[qs + i]; vd[i] = row[qs + kvs + i]; }
        }
        if ((rc = sgnb_paged_decode(q, k_buf, v_buf, req_to_token, row_stride, rows, starts, lens, B, H, Hkv, D,
                                    scale, att, lse, nthreads))) goto done;
        if ((rc = linear(f + LF_O, att, h, B, qs, hidden, nthreads))) goto done;
        for (int64_t i = 0; i < B * hidden; i++) res[i] += h[i];
        rms_norm_rows(res, (const float *)f[LF_POST_NORM], h, B, hidden, eps);
        if ((rc = linear(f + LF_GATE_UP, h, gu, B, hidden, 2 * inter, nthreads))) goto done;
        for (int64_t b = 0; b < B; b++) silu_mul_row(gu + b * 2 * inter, gu + b * 2 * inter + inter, act + b * inter, inter);
        if ((rc = linear(f + LF_DOWN, act, x, B, inter, hidden, nthreads))) goto done;
    }
    for (int64_t i = 0; i < B * hidden; i++) res[i] += x[i];
    rms_norm_rows(res, final_norm, x, B, hidden, eps);
done:
    free(res); free(h); free(qkv); free(q); free(att); free(lse); free(gu); free(act); free(starts);
    return rc;
}

/* ---- the module path's elementwise steps, one pass each ---------------------------------------------------

   A CPU extend too long for the one-call forward runs the model's modules, where torch spends ~100 us per
   elementwise op on a few hundred rows (each op a fresh pass over memory: an RMSNorm is eight of them). These
   do each step in one pass over rows that stay in cache, float32 as the torch references compute. */

/* with res: res += x (in place), then y = rmsnorm(res) * w; without: y = rmsnorm(x) * w. Row strides in
   elements; y may be x. */
int sgnb_rms_norm(const float *x, int64_t xs, float *res, int64_t rs, const float *w, float *y, int64_t ys,
                  int64_t M, int64_t n, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * n > 65536)
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * xs;
        float *src = res ? res + r * rs : (float *)xr;
        if (res) for (int64_t i = 0; i < n; i++) src[i] += xr[i];
        rms_norm_row(src, w, y + r * ys, n, eps);
    }
    return 0;
}

/* rotate-half rope in place: q (T rows of H heads of D, row stride qs), k (Hk heads, row stride ks), at
   positions pos (T,) of the tables cos / sin (P, D / 2) */
int sgnb_rope(float *q, int64_t qs, int64_t H, float *k, int64_t ks, int64_t Hk, int64_t D, const int64_t *pos,
              const float *cos_t, const float *sin_t, int64_t T, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * (H + Hk) * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        rotate_half(q + t * qs, H, D, c, s);
        rotate_half(k + t * ks, Hk, D, c, s);
    }
    return 0;
}

/* y (M, I) = silu(gate) * up of x (M, 2I) = [gate | up] (row stride xs) */
int sgnb_silu_mul(const float *x, int64_t xs, float *y, int64_t M, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * I > 65536)
    for (int64_t r = 0; r < M; r++) silu_mul_row(x + r * xs, x + r * xs + I, y + r * I, I);
    return 0;
}
