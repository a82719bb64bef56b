/* Products of a few input rows with one float32 or float16 weight matrix, reading the weights
 * once. The sums are float32 either way: half weights only halve the bytes read, which is what
 * a memory-bound decode step pays for (weights that came from a quantized or half checkpoint
 * lose nothing in float16).
 *
 * specd.cpu.row_products explains why; this is the compiled part. Built by pip with the
 * package (setup.py) when a C compiler is present; without it specd falls back to numpy.
 * The weight rows are shared between the calling thread and a pool of worker threads (one
 * per further CPU), handed out in pieces so a thread the OS lends to another process does
 * not hold up the product. The pool is the process's, whichever thread calls: OpenMP, used
 * first, kept one per calling thread, and two on two cores made every forward slower. Its
 * workers spin briefly between products and then sleep, so they do not hold a core that
 * the other services need between two forwards.
 * The rest of a few-token layer of specd.cpu.llama is here too (attention over the KV
 * cache, RMSNorm, RoPE, SwiGLU), one call each, on the calling thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* AVX2 + FMA where the CPU has them, plain x86-64 otherwise, chosen when the module loads */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* GCC does not vectorize half conversions itself: intrinsics, used if the CPU has F16C */
#define HALF_AVX2 1
#endif

#define GROUP 4                  /* input rows per pass over a weight row */
#define TILE_BYTES (256 << 10)   /* weight rows walked once per group: well inside L2 */
#define PIECES 16                /* pieces each parallel loop is cut into */

#define AHEAD 4                  /* weight rows fetched ahead of their use */

/* The hardware prefetcher alone left the four-row loop ~15 % short of memory speed. */
static inline void prefetch_row(const void *row, Py_ssize_t bytes) {
    for (Py_ssize_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b);
}

static Py_ssize_t piece(Py_ssize_t iterations) {
    Py_ssize_t p = iterations / PIECES;
    return p > 0 ? p : 1;
}

/* float16 bits -> float32, where no vector conversion is used */
#if defined(__aarch64__)
static inline float half_to_float(uint16_t h) {
    __fp16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);  /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: shift the leading one into place */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

#define AS_FLOAT(x) (x)
#define HALF_AS_FLOAT(x) half_to_float(x)

/* The span loops, once per weight type: SUFFIX names them, T is the stored type, LOAD makes a
 * float of it. Two input rows (a verify of one draft) do half the four-row loop's arithmetic. */
#define SPAN_LOOPS(SUFFIX, T, LOAD)                                                            \
    VECTOR_CLONES                                                                              \
    static void one_row_span##SUFFIX(const T *weight, const float *row, float *out,            \
                                     Py_ssize_t width, Py_ssize_t first, Py_ssize_t last) {    \
        for (Py_ssize_t o = first; o < last; o++) {                                            \
            const T *w = weight + o * width;                                                   \
            if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width * (Py_ssize_t)sizeof *w); \
            float a = 0.0f;                                                                    \
            _Pragma("omp simd reduction(+ : a)")                                               \
            for (Py_ssize_t k = 0; k < width; k++) a += LOAD(w[k]) * row[k];                   \
            out[o] = a;                                                                        \
        }                                                                                      \
    }                                                                                          \
    VECTOR_CLONES                                                                              \
    static void two_rows_span##SUFFIX(const T *weight, const float *rows, float *out,          \
                                      Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t first,  \
                                      Py_ssize_t last) {                                       \
        const float *x0 = rows, *x1 = rows + width;                                            \
        for (Py_ssize_t o = first; o < last; o++) {                                            \
            const T *w = weight + o * width;                                                   \
            if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width * (Py_ssize_t)sizeof *w); \
            float a = 0.0f, b = 0.0f;                                                          \
            _Pragma("omp simd reduction(+ : a, b)")                                            \
            for (Py_ssize_t k = 0; k < width; k++) {                                           \
                float wk = LOAD(w[k]);                                                         \
                a += wk * x0[k];                                                               \
                b += wk * x1[k];                                                               \
            }                                                                                  \
            out[o] = a;                                                                        \
            out[outputs + o] = b;                                                              \
        }                                                                                      \
    }                                                                                          \
    VECTOR_CLONES                                                                              \
    static void four_rows_span##SUFFIX(const T *weight, const float *rows, float *out,         \
                                       Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n,     \
                                       Py_ssize_t first, Py_ssize_t last) {                    \
        for (Py_ssize_t i = 0; i < n; i += GROUP) {                                            \
            const float *x0 = rows + i * width, *x1 = x0 + width, *x2 = x1 + width,            \
                        *x3 = x2 + width;                                                      \
            for (Py_ssize_t o = first; o < last; o++) {                                        \
                const T *w = weight + o * width;                                               \
                if (o + AHEAD < last)                                                          \
                    prefetch_row(w + AHEAD * width, width * (Py_ssize_t)sizeof *w);            \
                float a = 0.0f, b = 0.0f, c = 0.0f, d = 0.0f;                                  \
                _Pragma("omp simd reduction(+ : a, b, c, d)")                                  \
                for (Py_ssize_t k = 0; k < width; k++) {                                       \
                    float wk = LOAD(w[k]);                                                     \
                    a += wk * x0[k];                                                           \
                    b += wk * x1[k];                                                           \
                    c += wk * x2[k];                                                           \
                    d += wk * x3[k];                                                           \
                }                                                                              \
                out[i * outputs + o] = a;                                                      \
                out[(i + 1) * outputs + o] = b;                                                \
                out[(i + 2) * outputs + o] = c;                                                \
                out[(i + 3) * outputs + o] = d;                                                \
            }                                                                                  \
        }                                                                                      \
    }

SPAN_LOOPS(, float, AS_FLOAT)
SPAN_LOOPS(_half, uint16_t, HALF_AS_FLOAT)

#ifdef HALF_AVX2
/* Half weights on AVX2 + F16C: eight converted per instruction, two accumulators per input
 * row so the multiply-adds do not wait on each other. Tails (width % 16) in scalar code. */
#define F16C_TARGET __attribute__((target("avx2,fma,f16c")))
#define LOAD8(w, k) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((w) + (k))))

F16C_TARGET static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

F16C_TARGET
static void one_row_span_f16c(const uint16_t *weight, const float *row, float *out,
                              Py_ssize_t width, Py_ssize_t first, Py_ssize_t last) {
    Py_ssize_t vector_end = width & ~(Py_ssize_t)15;
    for (Py_ssize_t o = first; o < last; o++) {
        const uint16_t *w = weight + o * width;
        if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width * (Py_ssize_t)sizeof *w);
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        Py_ssize_t k = 0;
        for (; k < vector_end; k += 16) {
            a0 = _mm256_fmadd_ps(LOAD8(w, k), _mm256_loadu_ps(row + k), a0);
            a1 = _mm256_fmadd_ps(LOAD8(w, k + 8), _mm256_loadu_ps(row + k + 8), a1);
        }
        float a = sum8(_mm256_add_ps(a0, a1));
        for (; k < width; k++) a += half_to_float(w[k]) * row[k];
        out[o] = a;
    }
}

F16C_TARGET
static void two_rows_span_f16c(const uint16_t *weight, const float *rows, float *out,
                               Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t first,
                               Py_ssize_t last) {
    const float *x0 = rows, *x1 = rows + width;
    Py_ssize_t vector_end = width & ~(Py_ssize_t)15;
    for (Py_ssize_t o = first; o < last; o++) {
        const uint16_t *w = weight + o * width;
        if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width * (Py_ssize_t)sizeof *w);
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        Py_ssize_t k = 0;
        for (; k < vector_end; k += 16) {
            __m256 w0 = LOAD8(w, k), w1 = LOAD8(w, k + 8);
            a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
            a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + k + 8), a1);
            b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), b0);
            b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + k + 8), b1);
        }
        float a = sum8(_mm256_add_ps(a0, a1)), b = sum8(_mm256_add_ps(b0, b1));
        for (; k < width; k++) {
            float wk = half_to_float(w[k]);
            a += wk * x0[k];
            b += wk * x1[k];
        }
        out[o] = a;
        out[outputs + o] = b;
    }
}

/* Four input rows against one weight row, each input row summed as the one-row loop sums it
 * (two accumulators, alternate blocks of eight, then the scalar tail), so a verify's rows are
 * a decode step's numbers bit for bit. Eight accumulators, each weight vector serving four
 * multiply-adds. */
F16C_TARGET
static void four_rows_span_f16c(const uint16_t *weight, const float *rows, float *out,
                                Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n,
                                Py_ssize_t first, Py_ssize_t last) {
    Py_ssize_t vector_end = width & ~(Py_ssize_t)15;
    for (Py_ssize_t i = 0; i < n; i += GROUP) {
        const float *x[GROUP];
        for (int r = 0; r < GROUP; r++) x[r] = rows + (i + r) * width;
        for (Py_ssize_t o = first; o < last; o++) {
            const uint16_t *w = weight + o * width;
            if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width * (Py_ssize_t)sizeof *w);
            __m256 a[GROUP], b[GROUP];
            for (int r = 0; r < GROUP; r++) a[r] = b[r] = _mm256_setzero_ps();
            Py_ssize_t k = 0;
            for (; k < vector_end; k += 16) {
                __m256 w0 = LOAD8(w, k), w1 = LOAD8(w, k + 8);
                for (int r = 0; r < GROUP; r++) {
                    a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), a[r]);
                    b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k + 8), b[r]);
                }
            }
            for (int r = 0; r < GROUP; r++) {
                float s = sum8(_mm256_add_ps(a[r], b[r]));
                for (Py_ssize_t t = k; t < width; t++) s += half_to_float(w[t]) * x[r][t];
                out[(i + r) * outputs + o] = s;
            }
        }
    }
}

static int have_f16c;  /* set when the module loads */

/* Paired weights: two weight rows interleaved in blocks of sixteen halves, so the rows a loop
 * multiplies together are one stream in memory (two rows read side by side as two streams
 * ran at half the speed). Each loop takes a pair at a time, every input vector it loads
 * serving both rows: each (input row, weight row) pair is summed exactly as the one-row loop
 * above sums it (two accumulators, alternate blocks of eight). Four input rows' sums need
 * AVX-512VL's 32 vector registers (the arithmetic stays 256-bit); with AVX2's 16 a group of
 * four is two passes of two over the span, which the tiling keeps in L2. */
#define PAIRED_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
static int have_paired;       /* paired products run here: AVX2, FMA, F16C (set at load) */
static int have_paired_wide;  /* and four rows a pass: AVX-512VL */
/* an input vector GCC would otherwise load again as each multiply-add's memory operand */
#define IN_REGISTER(p, q) __asm__("" : "+v"(p), "+v"(q))

#define PAIRED_SPAN(ROWS, TARGET, SUFFIX)                                                      \
    TARGET static void paired_span_##ROWS##SUFFIX(const uint16_t *paired, const float *rows,   \
                                                  float *out, Py_ssize_t outputs,              \
                                                  Py_ssize_t width, Py_ssize_t first,          \
                                                  Py_ssize_t last) {                           \
        for (Py_ssize_t p = first; p < last; p++) {                                           \
            const uint16_t *w = paired + p * 2 * width;                                       \
            __m256 a[ROWS], b[ROWS], c[ROWS], d[ROWS];                                        \
            for (int r = 0; r < ROWS; r++) a[r] = b[r] = c[r] = d[r] = _mm256_setzero_ps();   \
            for (Py_ssize_t k = 0; k < width; k += 16, w += 32) {                             \
                __m256 w0 = LOAD8(w, 0), w1 = LOAD8(w, 8), v0 = LOAD8(w, 16),                 \
                       v1 = LOAD8(w, 24);                                                     \
                for (int r = 0; r < ROWS; r++) {                                              \
                    __m256 y0 = _mm256_loadu_ps(rows + r * width + k),                        \
                           y1 = _mm256_loadu_ps(rows + r * width + k + 8);                    \
                    IN_REGISTER(y0, y1);                                                      \
                    a[r] = _mm256_fmadd_ps(w0, y0, a[r]);                                     \
                    b[r] = _mm256_fmadd_ps(w1, y1, b[r]);                                     \
                    c[r] = _mm256_fmadd_ps(v0, y0, c[r]);                                     \
                    d[r] = _mm256_fmadd_ps(v1, y1, d[r]);                                     \
                }                                                                             \
            }                                                                                 \
            for (int r = 0; r < ROWS; r++) {                                                  \
                out[r * outputs + 2 * p] = sum8(_mm256_add_ps(a[r], b[r]));                   \
                out[r * outputs + 2 * p + 1] = sum8(_mm256_add_ps(c[r], d[r]));               \
            }                                                                                 \
        }                                                                                     \
    }
PAIRED_SPAN(1, PAIRED_TARGET, )
PAIRED_SPAN(2, PAIRED_TARGET, )
PAIRED_SPAN(4, PAIRED_TARGET, )
PAIRED_SPAN(1, F16C_TARGET, _avx2)
PAIRED_SPAN(2, F16C_TARGET, _avx2)
#endif

/* Weight rows are split into spans: for one or two input rows PIECES spans, for groups of four
 * spans of TILE_BYTES, each read from memory once and kept in L2 while every group of
 * input rows (in L1) passes over it. Threads claim `chunk` spans at a time. Other work
 * (attention_many) runs on the same pool through `task`, `outputs` then counting its units. */
typedef struct Job {
    const void *weight;
    const float *rows;
    float *out;
    Py_ssize_t outputs, width, n, span, spans, chunk;
    int half;  /* weight is float16 */
    void (*task)(const struct Job *job, Py_ssize_t first, Py_ssize_t last);
    const void *context;  /* the task's own arguments */
} Job;

static void run_span(const Job *job, Py_ssize_t first, Py_ssize_t last) {
    const float *rows = job->rows;
    float *out = job->out;
    Py_ssize_t outputs = job->outputs, width = job->width, n = job->n;
    if (!job->half) {
        const float *w = job->weight;
        if (n == 1) one_row_span(w, rows, out, width, first, last);
        else if (n == 2) two_rows_span(w, rows, out, outputs, width, first, last);
        else four_rows_span(w, rows, out, outputs, width, n, first, last);
        return;
    }
    const uint16_t *w = job->weight;
#ifdef HALF_AVX2
    if (have_f16c) {
        if (n == 1) one_row_span_f16c(w, rows, out, width, first, last);
        else if (n == 2) two_rows_span_f16c(w, rows, out, outputs, width, first, last);
        /* groups of four, each row summed as one row is: weights that cannot pair (an odd
         * number of rows) give a verify its decode step's numbers too */
        else four_rows_span_f16c(w, rows, out, outputs, width, n, first, last);
        return;
    }
#endif
    if (n == 1) one_row_span_half(w, rows, out, width, first, last);
    else if (n == 2) two_rows_span_half(w, rows, out, outputs, width, first, last);
    else four_rows_span_half(w, rows, out, outputs, width, n, first, last);
}

#ifdef HALF_AVX2
/* a span of pairs: one, two, or groups of four input rows, each group over the span (in L2) */
static void run_paired_span(const Job *job, Py_ssize_t first, Py_ssize_t last) {
    const uint16_t *w = job->weight;
    Py_ssize_t outputs = job->outputs * 2, width = job->width, n = job->n;
    if (!have_paired_wide) {
        for (Py_ssize_t i = 0; i < n; i += 2) {
            const float *rows = job->rows + i * width;
            float *out = job->out + i * outputs;
            if (n - i == 1) paired_span_1_avx2(w, rows, out, outputs, width, first, last);
            else paired_span_2_avx2(w, rows, out, outputs, width, first, last);
        }
        return;
    }
    if (n == 1) paired_span_1(w, job->rows, job->out, outputs, width, first, last);
    else if (n == 2) paired_span_2(w, job->rows, job->out, outputs, width, first, last);
    else
        for (Py_ssize_t i = 0; i < n; i += GROUP)
            paired_span_4(w, job->rows + i * width, job->out + i * outputs, outputs, width,
                          first, last);
}
#endif

static void run_spans(const Job *job, atomic_long *next) {
    for (;;) {
        Py_ssize_t t = atomic_fetch_add_explicit(next, job->chunk, memory_order_relaxed);
        if (t >= job->spans) return;
        Py_ssize_t stop = t + job->chunk < job->spans ? t + job->chunk : job->spans;
        for (; t < stop; t++) {
            Py_ssize_t first = t * job->span;
            Py_ssize_t last = first + job->span < job->outputs ? first + job->span : job->outputs;
            job->task(job, first, last);
        }
    }
}

#define MAX_WORKERS 15
#define SPIN_NS 300000L  /* a worker's wait for the next product before it sleeps */

static struct {
    pthread_mutex_t caller;  /* one job at a time; a second caller works alone */
    pthread_mutex_t lock;    /* publishing a job and waking sleepers */
    pthread_cond_t wake;
    Job job;                 /* written only while no worker is inside a job */
    atomic_uint generation;  /* bumped per job */
    atomic_long next;        /* the next span to claim */
    atomic_int inside;       /* workers inside the current job */
    atomic_uint open;        /* the generation workers may still enter; 0 once it is closed */
    int workers;             /* -1: not started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          .workers = -1};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static unsigned wait_for_job(unsigned seen) {
    long deadline = now_ns() + SPIN_NS;
    for (unsigned spins = 1;; spins++) {
        unsigned g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (g != seen) return g;
        cpu_relax();
        if (spins % 256 == 0 && now_ns() > deadline) break;
    }
    pthread_mutex_lock(&pool.lock);
    unsigned g;
    while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    return g;
}

static void *worker_main(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg;
    for (;;) {
        seen = wait_for_job(seen);
        /* a worker the OS had set aside until the job was done finds it closed, and the
         * caller never waits for it (with seq_cst, it sees `inside` or the worker sees 0) */
        atomic_fetch_add(&pool.inside, 1);
        if (atomic_load(&pool.open) == seen) run_spans(&pool.job, &pool.next);
        atomic_fetch_sub_explicit(&pool.inside, 1, memory_order_release);
    }
    return NULL;
}

static int cpus_available(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* A forked child has none of the parent's workers: it starts its own on first use. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.caller, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.inside, 0);
    atomic_store(&pool.open, 0);
    pool.workers = -1;
}

/* Called with pool.caller held. */
static void start_workers(void) {
    int wanted = cpus_available() - 1;
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    unsigned current = atomic_load(&pool.generation);
    pool.workers = 0;
    for (int i = 0; i < wanted; i++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&thread, &attr, worker_main, (void *)(uintptr_t)current) == 0)
            pool.workers++;
        pthread_attr_destroy(&attr);
    }
}

/* Runs every span of `job` on this thread and the pool's workers, or on this thread alone
 * while another thread has the pool. */
static void run_job(const Job *job) {
    atomic_long alone = 0;  /* the span counter when this thread does every span itself */
    if (pthread_mutex_trylock(&pool.caller) != 0) {  /* the pool is busy */
        run_spans(job, &alone);
        return;
    }
    if (pool.workers < 0) start_workers();
    if (pool.workers == 0 || job->spans == 1) {
        run_spans(job, &alone);
        pthread_mutex_unlock(&pool.caller);
        return;
    }
    pool.job = *job;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    unsigned g = atomic_load_explicit(&pool.generation, memory_order_relaxed) + 1;
    if (g == 0) g = 1;  /* 0 means closed */
    atomic_store(&pool.open, g);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.generation, g, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_spans(job, &pool.next);
    /* every span is claimed: wait for those that workers hold, not for workers that never
     * came in (asleep, or set aside by the OS while another process runs) */
    atomic_store(&pool.open, 0);
    while (atomic_load(&pool.inside) > 0) cpu_relax();
    pthread_mutex_unlock(&pool.caller);
}

static void products_in_spans(const void *weight, int half, const float *rows, float *out,
                              Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n) {
    Py_ssize_t row_bytes = width * (half ? 2 : (Py_ssize_t)sizeof(float));
    /* at least PIECES spans, so two threads share even a small product evenly */
    Py_ssize_t span = piece(outputs);
    if (n > 2 && span > TILE_BYTES / row_bytes) span = TILE_BYTES / row_bytes;
    if (span < 1) span = 1;
    Py_ssize_t spans = (outputs + span - 1) / span;
    Job job = {weight, rows, out, outputs, width, n, span, spans, n <= 2 ? 1 : piece(spans), half,
               run_span, NULL};
    run_job(&job);
}

/* The arrays of one call: each C-contiguous, of `ndim` dimensions, of one kind. */
enum { FLOAT32, BOOLEAN, FLOAT32_OR_16 };
typedef struct {
    const char *name;
    int ndim, writable, kind;
} ArraySpec;

static int has_kind(const Py_buffer *view, int kind) {
    if (kind == BOOLEAN) return strcmp(view->format, "?") == 0;
    if (view->itemsize == 4 && strcmp(view->format, "f") == 0) return 1;
    return kind == FLOAT32_OR_16 && view->itemsize == 2 && strcmp(view->format, "e") == 0;
}

static void release_arrays(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

static int take_arrays(PyObject **objs, const ArraySpec *specs, int count, Py_buffer *views) {
    for (int i = 0; i < count; i++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (specs[i].writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[i], &views[i], flags) < 0) {
            release_arrays(views, i);
            return -1;
        }
        if (views[i].ndim != specs[i].ndim || !has_kind(&views[i], specs[i].kind)) {
            static const char *kinds[] = {"float32", "bool", "float32 or float16"};
            PyErr_Format(PyExc_ValueError, "%s must be a %d-D C-contiguous %s array",
                         specs[i].name, specs[i].ndim, kinds[specs[i].kind]);
            release_arrays(views, i + 1);
            return -1;
        }
    }
    return 0;
}

static PyObject *finish(Py_buffer *views, int count, int ok, const char *error) {
    release_arrays(views, count);
    if (!ok) {
        if (error) PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* products(weight [O, K], rows [n, K], out [n, O]); n is 1, 2 or a multiple of GROUP; the
 * weight float32 or float16, rows and out float32 */
static PyObject *products(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2])) return NULL;
    static const ArraySpec specs[] = {
        {"weight", 2, 0, FLOAT32_OR_16}, {"rows", 2, 0, FLOAT32}, {"out", 2, 1, FLOAT32}};
    Py_buffer v[3];
    if (take_arrays(objs, specs, 3, v) < 0) return NULL;
    Py_ssize_t outputs = v[0].shape[0], width = v[0].shape[1], n = v[1].shape[0];
    if (v[1].shape[1] != width || v[2].shape[0] != n || v[2].shape[1] != outputs)
        return finish(v, 3, 0, "products: shapes do not match");
    if (n > 2 && n % GROUP != 0)
        return finish(v, 3, 0, "products: rows must be 1, 2 or a multiple of 4");
    if (width == 0) {
        memset(v[2].buf, 0, (size_t)v[2].len);  /* empty sums */
    } else {
        int half = v[0].itemsize == 2;
        Py_BEGIN_ALLOW_THREADS
        products_in_spans(v[0].buf, half, v[1].buf, v[2].buf, outputs, width, n);
        Py_END_ALLOW_THREADS
    }
    return finish(v, 3, 1, NULL);
}

/* paired_products(paired [O/2, 2K] float16, rows [n, K], out [n, O]): products() of the
 * weight that pair_rows laid out as `paired`, the same sums bit for bit */
static PyObject *paired_products(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2])) return NULL;
    static const ArraySpec specs[] = {
        {"paired", 2, 0, FLOAT32_OR_16}, {"rows", 2, 0, FLOAT32}, {"out", 2, 1, FLOAT32}};
    Py_buffer v[3];
    if (take_arrays(objs, specs, 3, v) < 0) return NULL;
#ifdef HALF_AVX2
    if (!have_paired)
        return finish(v, 3, 0, "paired_products: this CPU lacks AVX2, FMA or F16C");
    Py_ssize_t pairs = v[0].shape[0], width = v[0].shape[1] / 2, n = v[1].shape[0];
    if (v[0].itemsize != 2) return finish(v, 3, 0, "paired_products: paired must be float16");
    if (v[0].shape[1] % 32 != 0 || v[1].shape[1] != width || v[2].shape[0] != n ||
        v[2].shape[1] != 2 * pairs)
        return finish(v, 3, 0, "paired_products: shapes do not match");
    if (n > 2 && n % GROUP != 0)
        return finish(v, 3, 0, "paired_products: rows must be 1, 2 or a multiple of 4");
    Py_ssize_t pair_bytes = 4 * width;
    Py_ssize_t span = piece(pairs);
    if (n > 2 && span > TILE_BYTES / pair_bytes) span = TILE_BYTES / pair_bytes;
    if (span < 1) span = 1;
    Py_ssize_t spans = (pairs + span - 1) / span;
    Job job = {v[0].buf, v[1].buf, v[2].buf, pairs, width, n, span, spans,
               n <= 2 ? 1 : piece(spans), 1, run_paired_span, NULL};
    Py_BEGIN_ALLOW_THREADS
    if (pairs > 0) run_job(&job);
    Py_END_ALLOW_THREADS
    return finish(v, 3, 1, NULL);
#else
    return finish(v, 3, 0, "paired_products: not built with AVX2 support");
#endif
}

static PyObject *paired_supported(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#ifdef HALF_AVX2
    return PyBool_FromLong(have_paired && have_f16c);
#else
    Py_RETURN_FALSE;
#endif
}

/* ---- Attention of a few new tokens over the KV cache (specd.cpu.llama) ----
 * numpy spent ~150 us a layer on it for one token, nearly all of it in the dozen calls it
 * takes; the arithmetic is a few microseconds. */

/* e^x in float32 for x <= 0 (softmax inputs after the max is taken off) and moderate x;
 * polynomial on [-ln2/2, ln2/2] after range reduction, within ~2 ulp of expf, in a form
 * the compiler vectorizes. Below -87 it is 0, as the true value is at float precision. */
static inline float exp_of(float x) {
    float below = x < -87.0f ? 0.0f : 1.0f;  /* selects, not branches: they vectorize */
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f * below;
}

/* Eight floats as one value: SSE pairs in the plain x86-64 build, one AVX register in the
 * x86-64-v3 clone, NEON pairs on arm64 (GCC and clang both have these vectors). */
typedef float f8 __attribute__((vector_size(32)));

static inline f8 load8(const float *p) {
    f8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8_of(f8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* scores[r * stride + j] = query r . keys[j] for `rows` query rows [rows, dim] and `count`
 * keys of `dim` (a multiple of 8) floats; four keys at a time so their multiply-adds do not
 * wait on each other, each block of keys read once for every query row. */
VECTOR_CLONES
static void scores_of_rows(const float *queries, int rows, const float *keys, Py_ssize_t count,
                           Py_ssize_t dim, float *scores, Py_ssize_t stride) {
    Py_ssize_t j = 0;
    for (; j + 4 <= count; j += 4) {
        const float *k0 = keys + j * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
        for (int r = 0; r < rows; r++) {
            const float *query = queries + r * dim;
            f8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (Py_ssize_t d = 0; d < dim; d += 8) {
                f8 q = load8(query + d);
                a0 += q * load8(k0 + d);
                a1 += q * load8(k1 + d);
                a2 += q * load8(k2 + d);
                a3 += q * load8(k3 + d);
            }
            float *s = scores + r * stride + j;
            s[0] = sum8_of(a0), s[1] = sum8_of(a1), s[2] = sum8_of(a2), s[3] = sum8_of(a3);
        }
    }
    for (; j < count; j++) {
        const float *k = keys + j * dim;
        for (int r = 0; r < rows; r++) {
            f8 a = {0};
            for (Py_ssize_t d = 0; d < dim; d += 8) a += load8(queries + r * dim + d) * load8(k + d);
            scores[r * stride + j] = sum8_of(a);
        }
    }
}

static void scores_of(const float *query, const float *keys, Py_ssize_t count, Py_ssize_t dim,
                      float *scores) {
    scores_of_rows(query, 1, keys, count, dim, scores, 0);
}

/* scores[0:total] become e^(score - max), in place; returns their sum (eight partial sums,
 * key j in lane j % 8, whatever the count). */
VECTOR_CLONES
static float softmax_of(float *scores, Py_ssize_t total) {
    float m = -INFINITY;
    for (Py_ssize_t j = 0; j < total; j++) m = scores[j] > m ? scores[j] : m;
    f8 lanes = {0};
    Py_ssize_t j = 0;
    for (; j + 8 <= total; j += 8) {
        f8 e;
        for (int l = 0; l < 8; l++) e[l] = scores[j + l] = exp_of(scores[j + l] - m);
        lanes += e;
    }
    for (int l = 0; j < total; j++, l++) lanes[l] += scores[j] = exp_of(scores[j] - m);
    return sum8_of(lanes);
}

/* One query row: scores over the `past` cached keys and the `fresh` new ones it sees, their
 * softmax, and the weighted sum of values into out [dim]. scores has past + fresh floats.
 * The keys it sees are taken as one sequence, past then the new ones it sees in order, and
 * every sum runs over that sequence alone: so a verify's row is the number the decode step
 * at its place computes, where the same keys are all past (a new key it does not see, a
 * later draft or a tree's other branch, takes no place in any sum). */
VECTOR_CLONES
static void attend_one(const float *query, const float *keys, const float *values,
                       Py_ssize_t past, const float *new_keys, const float *new_values,
                       Py_ssize_t fresh, const unsigned char *sees, Py_ssize_t dim,
                       float *scores, float *out) {
    scores_of(query, keys, past, dim, scores);
    Py_ssize_t total = past;
    for (Py_ssize_t j = 0; j < fresh; j++)
        if (sees[j]) scores_of(query, new_keys + j * dim, 1, dim, scores + total++);
    float sum = softmax_of(scores, total);
    for (Py_ssize_t d0 = 0; d0 < dim; d0 += 64) {
        Py_ssize_t width = dim - d0 < 64 ? dim - d0 : 64;
        f8 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = (f8){0};
        for (Py_ssize_t i = 0; i < past; i++) {
            const float *row = values + i * dim + d0;
            for (int c = 0; c < width / 8; c++) acc[c] += scores[i] * load8(row + 8 * c);
        }
        for (Py_ssize_t i = 0, k = past; i < fresh; i++) {
            if (!sees[i]) continue;
            const float *row = new_values + i * dim + d0;
            float w = scores[k++];
            for (int c = 0; c < width / 8; c++) acc[c] += w * load8(row + 8 * c);
        }
        for (int c = 0; c < width / 8; c++) memcpy(out + d0 + 8 * c, &acc[c], sizeof acc[c]);
    }
    float inverse = 1.0f / sum;
    for (Py_ssize_t d = 0; d < dim; d++) out[d] *= inverse;
}

/* Keys whose values a grouped pass sums before moving to the next query row: the block's values
 * stay in L1 while every query of the group reads them. */
#define VALUE_BLOCK 32
/* sequences x KV heads from which a KV head's query heads are a unit of work together */
#define ATTENTION_UNITS_SHARED 8

/* The `count` query rows of one KV head (grouped-query attention), [count, dim] in `queries`,
 * into out [count, dim]: each row bit for bit what attend_one computes for it, every sum in
 * the same order, but each block of keys and values read once for the group instead of once a
 * row. scores holds count * stride floats (stride >= past + fresh). */
VECTOR_CLONES
static void attend_heads(const float *queries, int count, const float *keys,
                         const float *values, Py_ssize_t past, const float *new_keys,
                         const float *new_values, Py_ssize_t fresh, const unsigned char *sees,
                         Py_ssize_t dim, float *scores, Py_ssize_t stride, float *out) {
    scores_of_rows(queries, count, keys, past, dim, scores, stride);
    float sums[count];
    for (int h = 0; h < count; h++) {
        const float *query = queries + h * dim;
        float *s = scores + h * stride;
        Py_ssize_t total = past;
        for (Py_ssize_t n = 0; n < fresh; n++)
            if (sees[n]) scores_of(query, new_keys + n * dim, 1, dim, s + total++);
        sums[h] = softmax_of(s, total);
    }
    for (Py_ssize_t d0 = 0; d0 < dim; d0 += 64) {
        Py_ssize_t width = dim - d0 < 64 ? dim - d0 : 64;
        for (int h = 0; h < count; h++) memset(out + h * dim + d0, 0, sizeof(float) * width);
        for (Py_ssize_t i0 = 0; i0 < past; i0 += VALUE_BLOCK) {
            Py_ssize_t i1 = i0 + VALUE_BLOCK < past ? i0 + VALUE_BLOCK : past;
            for (int h = 0; h < count; h++) {
                const float *s = scores + h * stride;
                f8 acc[8];
                for (int c = 0; c < width / 8; c++) acc[c] = load8(out + h * dim + d0 + 8 * c);
                for (Py_ssize_t i = i0; i < i1; i++) {
                    const float *row = values + i * dim + d0;
                    for (int c = 0; c < width / 8; c++) acc[c] += s[i] * load8(row + 8 * c);
                }
                for (int c = 0; c < width / 8; c++)
                    memcpy(out + h * dim + d0 + 8 * c, &acc[c], sizeof acc[c]);
            }
        }
        for (int h = 0; h < count; h++) {
            const float *s = scores + h * stride;
            f8 acc[8];
            for (int c = 0; c < width / 8; c++) acc[c] = load8(out + h * dim + d0 + 8 * c);
            for (Py_ssize_t i = 0, k = past; i < fresh; i++) {
                if (!sees[i]) continue;
                const float *row = new_values + i * dim + d0;
                float w = s[k++];
                for (int c = 0; c < width / 8; c++) acc[c] += w * load8(row + 8 * c);
            }
            for (int c = 0; c < width / 8; c++)
                memcpy(out + h * dim + d0 + 8 * c, &acc[c], sizeof acc[c]);
        }
    }
    for (int h = 0; h < count; h++) {
        float inverse = 1.0f / sums[h];
        for (Py_ssize_t d = 0; d < dim; d++) out[h * dim + d] *= inverse;
    }
}

/* attention(queries [H, T, D], new_keys [G, T, D], new_values [G, T, D], keys [G, C, D],
 *           values [G, C, D], past, sees [T, T] bool, out [T, H * D])
 * Query head h reads kv head h / (H / G); the first `past` of the C cached rows are the
 * past; new token t sees new token j where sees[t, j]. Queries come scaled; the head size D
 * is a multiple of 8. */
static PyObject *attention(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[7];
    Py_ssize_t past;
    if (!PyArg_ParseTuple(args, "OOOOOnOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &past, &objs[5], &objs[6]))
        return NULL;
    static const ArraySpec specs[] = {
        {"queries", 3, 0, FLOAT32}, {"new_keys", 3, 0, FLOAT32}, {"new_values", 3, 0, FLOAT32},
        {"keys", 3, 0, FLOAT32},    {"values", 3, 0, FLOAT32},   {"sees", 2, 0, BOOLEAN},
        {"out", 2, 1, FLOAT32}};
    Py_buffer v[7];
    if (take_arrays(objs, specs, 7, v) < 0) return NULL;
    Py_ssize_t heads = v[0].shape[0], tokens = v[0].shape[1], dim = v[0].shape[2];
    Py_ssize_t groups = v[1].shape[0], capacity = v[3].shape[1];
    int ok = groups > 0 && heads % groups == 0 && dim % 8 == 0 && past >= 0 &&
             past <= capacity;
    for (int i = 1; i < 3; i++)
        ok = ok && v[i].shape[0] == groups && v[i].shape[1] == tokens && v[i].shape[2] == dim;
    for (int i = 3; i < 5; i++)
        ok = ok && v[i].shape[0] == groups && v[i].shape[1] == capacity && v[i].shape[2] == dim;
    ok = ok && v[5].shape[0] == tokens && v[5].shape[1] == tokens && v[6].shape[0] == tokens &&
         v[6].shape[1] == heads * dim;
    if (!ok)
        return finish(v, 7, 0,
                      "attention: shapes do not match (or a head size not a multiple of 8)");
    float *scores = malloc(sizeof(float) * (size_t)(past + tokens + 1));
    if (scores == NULL) {
        release_arrays(v, 7);
        return PyErr_NoMemory();
    }
    const float *q = v[0].buf, *nk = v[1].buf, *nv = v[2].buf, *k = v[3].buf, *vals = v[4].buf;
    const unsigned char *sees = v[5].buf;
    float *out = v[6].buf;
    Py_ssize_t group = heads / groups;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t h = 0; h < heads; h++) {
        Py_ssize_t g = h / group;
        for (Py_ssize_t t = 0; t < tokens; t++)
            attend_one(q + (h * tokens + t) * dim, k + g * capacity * dim,
                       vals + g * capacity * dim, past, nk + g * tokens * dim,
                       nv + g * tokens * dim, tokens, sees + t * tokens, dim, scores,
                       out + t * heads * dim + h * dim);
    }
    Py_END_ALLOW_THREADS
    free(scores);
    return finish(v, 7, 1, NULL);
}

/* ---- Attention of several sequences' new tokens, each over its own KV cache, in one call:
 * per layer one call for all the sessions of a shared forward (not one each), their heads
 * shared out to the pool's threads. The new keys and values are first written into each
 * cache's buffer, where the next forward reads them. */
typedef struct {
    const float *queries;      /* [H, N, D], not yet scaled */
    float *out;                /* [N, H * D] */
    const Py_buffer *keys, *values, *sees;  /* per sequence: [G, C, D] twice, [T, T] */
    const Py_ssize_t *pasts, *bounds;       /* per sequence; bounds has one more */
    Py_ssize_t heads, groups, tokens, dim, longest;  /* longest: most rows a query sees */
    float scale;
    Py_ssize_t together;  /* query heads a unit of work takes: those of a KV head, or one */
} ManyAttention;

/* units [first, last) of sequence x `together` query heads (all of a KV head's, or one) */
static void attention_units(const Job *job, Py_ssize_t first, Py_ssize_t last) {
    const ManyAttention *a = job->context;
    Py_ssize_t dim = a->dim, group = a->together, stride = a->longest + 1;
    Py_ssize_t units = a->heads / group;  /* a sequence's */
    float *scratch = malloc(sizeof(float) * (size_t)(group * (stride + dim)));
    if (scratch == NULL) abort();  /* a few KiB; no way to raise from a worker */
    float *queries = scratch + group * stride;
    for (Py_ssize_t u = first; u < last; u++) {
        Py_ssize_t s = u / units, head = u % units * group, g = head / (a->heads / a->groups);
        Py_ssize_t start = a->bounds[s], fresh = a->bounds[s + 1] - start, past = a->pasts[s];
        Py_ssize_t capacity = a->keys[s].shape[1];
        const float *keys = (const float *)a->keys[s].buf + g * capacity * dim;
        const float *values = (const float *)a->values[s].buf + g * capacity * dim;
        const unsigned char *sees = a->sees[s].buf;
        for (Py_ssize_t t = 0; t < fresh; t++) {
            for (Py_ssize_t r = 0; r < group; r++) {
                const float *q = a->queries + ((head + r) * a->tokens + start + t) * dim;
                for (Py_ssize_t d = 0; d < dim; d++) queries[r * dim + d] = q[d] * a->scale;
            }
            float *out = a->out + (start + t) * a->heads * dim + head * dim;
            if (group == 1)
                attend_one(queries, keys, values, past, keys + past * dim, values + past * dim,
                           fresh, sees + t * fresh, dim, scratch, out);
            else
                attend_heads(queries, (int)group, keys, values, past, keys + past * dim,
                             values + past * dim, fresh, sees + t * fresh, dim, scratch, stride,
                             out);
        }
    }
    free(scratch);
}

static void release_list(Py_buffer *views, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

/* Each item of `list` (a sequence of `count`) as a C-contiguous array of `ndim` dimensions;
 * -1 (an error set, none held) if one is not. */
static int take_list(PyObject *list, Py_ssize_t count, int ndim, int writable, int kind,
                     const char *name, Py_buffer *views) {
    PyObject *items = PySequence_Fast(list, name);
    if (items == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(items) != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd arrays for %zd sequences", name,
                     PySequence_Fast_GET_SIZE(items), count);
        Py_DECREF(items);
        return -1;
    }
    ArraySpec spec = {name, ndim, writable, kind};
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        if (take_arrays(&item, &spec, 1, &views[i]) < 0) {
            release_list(views, i);
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    return 0;
}

static int take_sizes(PyObject *list, Py_ssize_t count, const char *name, Py_ssize_t *out) {
    PyObject *items = PySequence_Fast(list, name);
    if (items == NULL) return -1;
    int ok = PySequence_Fast_GET_SIZE(items) == count;
    for (Py_ssize_t i = 0; ok && i < count; i++) {
        out[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(items, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(items);
            return -1;
        }
    }
    Py_DECREF(items);
    if (!ok) PyErr_Format(PyExc_ValueError, "%s: wrong length", name);
    return ok ? 0 : -1;
}

/* attention_many(queries [H, N, D], new_keys [G, N, D], new_values [G, N, D], keys, values,
 *                pasts, bounds, sees, scale, out [N, H * D])
 * S sequences, rows bounds[s]:bounds[s + 1] of N theirs: keys and values are S writable
 * [G, C_s, D] cache buffers whose first pasts[s] rows are the past; the sequence's new keys
 * and values are written after them, then each of its queries (scaled by `scale`) attends to
 * the past and to its new tokens as sees[s] [T_s, T_s] bool says. As `attention` otherwise. */
static PyObject *attention_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[4], *lists[5];
    float scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOfO", &objs[0], &objs[1], &objs[2], &lists[0], &lists[1],
                          &lists[2], &lists[3], &lists[4], &scale, &objs[3]))
        return NULL;
    Py_ssize_t count = PySequence_Size(lists[2]);
    if (count < 0) return NULL;
    if (count == 0) return PyErr_Format(PyExc_ValueError, "attention_many: no sequences");
    static const ArraySpec specs[] = {{"queries", 3, 0, FLOAT32},
                                      {"new_keys", 3, 0, FLOAT32},
                                      {"new_values", 3, 0, FLOAT32},
                                      {"out", 2, 1, FLOAT32}};
    Py_buffer v[4];
    if (take_arrays(objs, specs, 4, v) < 0) return NULL;
    Py_ssize_t *sizes = malloc(sizeof(Py_ssize_t) * (size_t)(2 * count + 1));
    Py_buffer *views = malloc(sizeof(Py_buffer) * (size_t)(3 * count));
    if (sizes == NULL || views == NULL) {
        free(sizes);
        free(views);
        release_arrays(v, 4);
        return PyErr_NoMemory();
    }
    Py_ssize_t *pasts = sizes, *bounds = sizes + count;
    Py_buffer *keys = views, *values = views + count, *sees = views + 2 * count;
    int held = 0;  /* lists taken */
    PyObject *result = NULL;
    if (take_sizes(lists[2], count, "pasts", pasts) < 0 ||
        take_sizes(lists[3], count + 1, "bounds", bounds) < 0)
        goto done;
    if (take_list(lists[0], count, 3, 1, FLOAT32, "keys", keys) < 0) goto done;
    held = 1;
    if (take_list(lists[1], count, 3, 1, FLOAT32, "values", values) < 0) goto done;
    held = 2;
    if (take_list(lists[4], count, 2, 0, BOOLEAN, "sees", sees) < 0) goto done;
    held = 3;
    Py_ssize_t heads = v[0].shape[0], tokens = v[0].shape[1], dim = v[0].shape[2];
    Py_ssize_t groups = v[1].shape[0], longest = 0;
    int ok = groups > 0 && heads % groups == 0 && dim % 8 == 0 && bounds[0] == 0 &&
             bounds[count] == tokens && v[3].shape[0] == tokens && v[3].shape[1] == heads * dim;
    for (int i = 1; i < 3; i++)
        ok = ok && v[i].shape[0] == groups && v[i].shape[1] == tokens && v[i].shape[2] == dim;
    for (Py_ssize_t s = 0; ok && s < count; s++) {
        Py_ssize_t fresh = bounds[s + 1] - bounds[s], capacity = keys[s].shape[1];
        ok = fresh > 0 && pasts[s] >= 0 && pasts[s] + fresh <= capacity &&
             keys[s].shape[0] == groups && keys[s].shape[2] == dim &&
             values[s].shape[0] == groups && values[s].shape[1] == capacity &&
             values[s].shape[2] == dim && sees[s].shape[0] == fresh && sees[s].shape[1] == fresh;
        if (pasts[s] + fresh > longest) longest = pasts[s] + fresh;
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "attention_many: shapes do not match (or a head size "
                                          "not a multiple of 8, or a cache without room)");
        goto done;
    }
    /* a KV head's query heads together read its keys and values once; with few sequences,
     * one head a unit, so the pool's threads get work enough to share */
    Py_ssize_t together = count * groups >= ATTENTION_UNITS_SHARED ? heads / groups : 1;
    ManyAttention context = {v[0].buf, v[3].buf, keys,   values, sees,    pasts, bounds,
                             heads,    groups,   tokens, dim,    longest, scale, together};
    Py_ssize_t units = count * heads / together;
    Job job = {.outputs = units, .span = 1, .spans = units, .chunk = piece(units),
               .task = attention_units, .context = &context};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < count; s++) {
        Py_ssize_t start = bounds[s], fresh = bounds[s + 1] - start;
        Py_ssize_t capacity = keys[s].shape[1], bytes = sizeof(float) * fresh * dim;
        for (Py_ssize_t g = 0; g < groups; g++) {
            Py_ssize_t to = (g * capacity + pasts[s]) * dim, from = (g * tokens + start) * dim;
            memcpy((float *)keys[s].buf + to, (const float *)v[1].buf + from, (size_t)bytes);
            memcpy((float *)values[s].buf + to, (const float *)v[2].buf + from, (size_t)bytes);
        }
    }
    run_job(&job);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (held >= 1) release_list(keys, count);
    if (held >= 2) release_list(values, count);
    if (held >= 3) release_list(sees, count);
    free(sizes);
    free(views);
    release_arrays(v, 4);
    return result;
}

VECTOR_CLONES
static void norm_rows(const float *h, const float *weight, float eps, Py_ssize_t rows,
                      Py_ssize_t width, float *out) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *x = h + r * width;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (Py_ssize_t k = 0; k < width; k++) squares += x[k] * x[k];
        float scale = 1.0f / sqrtf(squares / (float)width + eps);
#pragma omp simd
        for (Py_ssize_t k = 0; k < width; k++) out[r * width + k] = x[k] * scale * weight[k];
    }
}

/* rms_norm(h [T, H], weight [H], eps, out [T, H]): h / sqrt(mean(h^2) + eps) * weight */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[3];
    float eps;
    if (!PyArg_ParseTuple(args, "OOfO", &objs[0], &objs[1], &eps, &objs[2])) return NULL;
    static const ArraySpec specs[] = {
        {"h", 2, 0, FLOAT32}, {"weight", 1, 0, FLOAT32}, {"out", 2, 1, FLOAT32}};
    Py_buffer v[3];
    if (take_arrays(objs, specs, 3, v) < 0) return NULL;
    Py_ssize_t rows = v[0].shape[0], width = v[0].shape[1];
    if (width == 0 || v[1].shape[0] != width || v[2].shape[0] != rows || v[2].shape[1] != width)
        return finish(v, 3, 0, "rms_norm: shapes do not match");
    norm_rows(v[0].buf, v[1].buf, eps, rows, width, v[2].buf);
    return finish(v, 3, 1, NULL);
}

/* rope(x [T, heads * D], cos [T, dims / 2], sin [T, dims / 2], traditional, out [heads, T, D]):
 * each head's first `dims` features turned pairwise by its token's angles (pairs (i, i + dims/2),
 * or (2i, 2i + 1) when traditional), the rest copied; heads moved first. */
static PyObject *rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[4];
    int traditional;
    if (!PyArg_ParseTuple(args, "OOOpO", &objs[0], &objs[1], &objs[2], &traditional, &objs[3]))
        return NULL;
    static const ArraySpec specs[] = {
        {"x", 2, 0, FLOAT32}, {"cos", 2, 0, FLOAT32}, {"sin", 2, 0, FLOAT32},
        {"out", 3, 1, FLOAT32}};
    Py_buffer v[4];
    if (take_arrays(objs, specs, 4, v) < 0) return NULL;
    Py_ssize_t tokens = v[0].shape[0], heads = v[3].shape[0], dim = v[3].shape[2];
    Py_ssize_t half = v[1].shape[1];
    int ok = v[3].shape[1] == tokens && v[0].shape[1] == heads * dim && 2 * half <= dim;
    for (int i = 1; i < 3; i++) ok = ok && v[i].shape[0] == tokens && v[i].shape[1] == half;
    if (!ok) return finish(v, 4, 0, "rope: shapes do not match");
    const float *x = v[0].buf, *cosines = v[1].buf, *sines = v[2].buf;
    float *out = v[3].buf;
    for (Py_ssize_t t = 0; t < tokens; t++) {
        const float *c = cosines + t * half, *s = sines + t * half;
        for (Py_ssize_t h = 0; h < heads; h++) {
            const float *src = x + t * heads * dim + h * dim;
            float *dst = out + (h * tokens + t) * dim;
            Py_ssize_t step = traditional ? 1 : half, stride = traditional ? 2 : 1;
            for (Py_ssize_t i = 0; i < half; i++) {
                Py_ssize_t first = i * stride, second = first + step;
                float a = src[first], b = src[second];
                dst[first] = a * c[i] - b * s[i];
                dst[second] = a * s[i] + b * c[i];
            }
            for (Py_ssize_t i = 2 * half; i < dim; i++) dst[i] = src[i];
        }
    }
    return finish(v, 4, 1, NULL);
}

VECTOR_CLONES
static void swiglu_rows(float *gate, const float *up, Py_ssize_t count) {
#pragma omp simd
    for (Py_ssize_t k = 0; k < count; k++) {
        float g = gate[k];
        gate[k] = g / (1.0f + exp_of(-g)) * up[k];
    }
}

/* A few rows' SwiGLU is ~40 us on one thread: spans of it go to the pool's threads. */
#define SWIGLU_SPAN 2048
typedef struct {
    float *gate;
    const float *up;
} SwigluArgs;

static void swiglu_span(const Job *job, Py_ssize_t first, Py_ssize_t last) {
    const SwigluArgs *a = job->context;
    swiglu_rows(a->gate + first, a->up + first, last - first);
}

/* swiglu(gate [T, F], up [T, F]): gate becomes silu(gate) * up, in place */
static PyObject *swiglu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[2];
    if (!PyArg_ParseTuple(args, "OO", &objs[0], &objs[1])) return NULL;
    static const ArraySpec specs[] = {{"gate", 2, 1, FLOAT32}, {"up", 2, 0, FLOAT32}};
    Py_buffer v[2];
    if (take_arrays(objs, specs, 2, v) < 0) return NULL;
    if (v[0].shape[0] != v[1].shape[0] || v[0].shape[1] != v[1].shape[1])
        return finish(v, 2, 0, "swiglu: shapes do not match");
    SwigluArgs context = {v[0].buf, v[1].buf};
    Py_ssize_t count = v[0].shape[0] * v[0].shape[1];
    Job job = {.outputs = count, .span = SWIGLU_SPAN, .spans = (count + SWIGLU_SPAN - 1) / SWIGLU_SPAN,
               .chunk = 1, .task = swiglu_span, .context = &context};
    Py_BEGIN_ALLOW_THREADS
    if (job.spans > 0) run_job(&job);
    Py_END_ALLOW_THREADS
    return finish(v, 2, 1, NULL);
}

#ifdef HALF_AVX2
static int cpu_f16c, cpu_wide;  /* what the CPU has (set at load): the most these flags may be */

/* For tests: `*flag` set to `arg` where the CPU allows (`possible`); returns its old value. */
static PyObject *switch_flag(PyObject *arg, int *flag, int possible) {
    int wanted = PyObject_IsTrue(arg);
    if (wanted < 0) return NULL;
    int was = *flag;
    *flag = wanted && possible;
    return PyBool_FromLong(was);
}
#endif

/* For tests: route half weights through the portable loops (False) or back (True, where the
 * CPU has F16C); returns whether the vector loops were in use. */
static PyObject *vector_half(PyObject *self, PyObject *arg) {
    (void)self;
#ifdef HALF_AVX2
    return switch_flag(arg, &have_f16c, cpu_f16c);
#else
    if (PyObject_IsTrue(arg) < 0) return NULL;
    Py_RETURN_FALSE;
#endif
}

/* For tests: paired products four input rows a pass (True, where the CPU has AVX-512VL) or
 * two (False, as on AVX2 alone); returns whether four were in use. */
static PyObject *paired_wide(PyObject *self, PyObject *arg) {
    (void)self;
#ifdef HALF_AVX2
    return switch_flag(arg, &have_paired_wide, cpu_wide && have_paired);
#else
    if (PyObject_IsTrue(arg) < 0) return NULL;
    Py_RETURN_FALSE;
#endif
}

/* Input rows a paired pass takes: 4 with AVX-512VL, 2 with AVX2 alone, 0 without pairs. */
static PyObject *paired_rows_a_pass(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#ifdef HALF_AVX2
    return PyLong_FromLong(!(have_paired && have_f16c) ? 0 : have_paired_wide ? 4 : 2);
#else
    return PyLong_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"products", products, METH_VARARGS,
     "products(weight, rows, out): out = rows @ weight.T in float32; 1, 2 or 4k rows; "
     "weight float32 or float16"},
    {"attention", attention, METH_VARARGS,
     "attention(queries, new_keys, new_values, keys, values, past, sees, out): a few new "
     "tokens' attention over a KV cache, float32"},
    {"attention_many", attention_many, METH_VARARGS,
     "attention_many(queries, new_keys, new_values, keys, values, pasts, bounds, sees, scale, "
     "out): several sequences' new tokens written into their KV caches and attending to them"},
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(h, weight, eps, out): out = h / sqrt(mean(h^2) + eps) * weight, per row"},
    {"rope", rope, METH_VARARGS,
     "rope(x, cos, sin, traditional, out): rotary positions, [T, heads*D] -> [heads, T, D]"},
    {"swiglu", swiglu, METH_VARARGS, "swiglu(gate, up): gate = silu(gate) * up, in place"},
    {"paired_products", paired_products, METH_VARARGS,
     "paired_products(paired, rows, out): products() of a float16 weight laid out in pairs "
     "of rows (specd.cpu.row_products.pair_rows); 1, 2 or 4k rows"},
    {"paired_supported", paired_supported, METH_NOARGS,
     "paired_supported() -> whether this CPU runs paired_products"},
    {"paired_rows_a_pass", paired_rows_a_pass, METH_NOARGS,
     "paired_rows_a_pass() -> input rows a paired pass takes (4, 2, or 0 without pairs)"},
    {"paired_wide", paired_wide, METH_O,
     "paired_wide(enabled) -> was: paired products four input rows a pass or two"},
    {"vector_half", vector_half, METH_O,
     "vector_half(enabled) -> was: half weights through the F16C loops or the portable ones"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_kernels(void) {
#ifdef HALF_AVX2
    __builtin_cpu_init();
    cpu_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    cpu_wide = cpu_f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
    have_f16c = have_paired = cpu_f16c;
    have_paired_wide = cpu_wide;
#endif
    pthread_atfork(NULL, NULL, forget_workers);
    return PyModule_Create(&module);
}
