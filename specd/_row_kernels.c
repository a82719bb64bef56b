/* Products of a few input rows with one float32 or float16 weight matrix, reading the weights
 * once. The sums are float32 either way: half weights only halve the bytes read, which is what
 * a memory-bound decode step pays for (weights that came from a quantized or half checkpoint
 * lose nothing in float16).
 *
 * specd.models.row_products explains why; this is the compiled part. Built by pip with the
 * package (setup.py) when a C compiler is present; without it specd falls back to numpy.
 * The weight rows are shared between the calling thread and a pool of worker threads (one
 * per further CPU), handed out in pieces so a thread the OS lends to another process does
 * not hold up the product. The pool is the process's, whichever thread calls: OpenMP, used
 * first, kept one per calling thread, and two on two cores made every forward slower. Its
 * workers spin briefly between products and then sleep, so they do not hold a core that
 * the other services need between two forwards.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
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
#define HALF_AVX2 1  /* GCC does not vectorize half conversions itself: intrinsics, if the CPU has F16C */
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
            __m256 lo[GROUP], hi[GROUP];
            for (int r = 0; r < GROUP; r++) lo[r] = hi[r] = _mm256_setzero_ps();
            Py_ssize_t k = 0;
            for (; k < vector_end; k += 16) {
                __m256 w0 = LOAD8(w, k), w1 = LOAD8(w, k + 8);
                for (int r = 0; r < GROUP; r++) {
                    lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), lo[r]);
                    hi[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k + 8), hi[r]);
                }
            }
            for (int r = 0; r < GROUP; r++) {
                float s = sum8(_mm256_add_ps(lo[r], hi[r]));
                for (Py_ssize_t t = k; t < width; t++) s += half_to_float(w[t]) * x[r][t];
                out[(i + r) * outputs + o] = s;
            }
        }
    }
}

static int have_f16c;  /* set when the module loads */
#endif

/* Weight rows are split into spans: for one or two input rows PIECES spans, for groups of four
 * spans of TILE_BYTES, each read from memory once and kept in L2 while every group of
 * input rows (in L1) passes over it. Threads claim `chunk` spans at a time. */
typedef struct {
    const void *weight;
    const float *rows;
    float *out;
    Py_ssize_t outputs, width, n, span, spans, chunk;
    int half;  /* weight is float16 */
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
        else four_rows_span_f16c(w, rows, out, outputs, width, n, first, last);
        return;
    }
#endif
    if (n == 1) one_row_span_half(w, rows, out, width, first, last);
    else if (n == 2) two_rows_span_half(w, rows, out, outputs, width, first, last);
    else four_rows_span_half(w, rows, out, outputs, width, n, first, last);
}

static void run_spans(const Job *job, atomic_long *next) {
    for (;;) {
        Py_ssize_t t = atomic_fetch_add_explicit(next, job->chunk, memory_order_relaxed);
        if (t >= job->spans) return;
        Py_ssize_t stop = t + job->chunk < job->spans ? t + job->chunk : job->spans;
        for (; t < stop; t++) {
            Py_ssize_t first = t * job->span;
            Py_ssize_t last = first + job->span < job->outputs ? first + job->span : job->outputs;
            run_span(job, first, last);
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
    atomic_int busy;         /* workers not yet done with the current job */
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
        run_spans(&pool.job, &pool.next);
        atomic_fetch_sub_explicit(&pool.busy, 1, memory_order_release);
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
    atomic_store(&pool.busy, 0);
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

static void products_in_spans(const void *weight, int half, const float *rows, float *out,
                              Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n) {
    Py_ssize_t row_bytes = width * (half ? 2 : (Py_ssize_t)sizeof(float));
    Py_ssize_t span = n <= 2 ? piece(outputs) : TILE_BYTES / row_bytes;
    if (span < 1) span = 1;
    Py_ssize_t spans = (outputs + span - 1) / span;
    Job job = {weight, rows, out, outputs, width, n, span, spans, n <= 2 ? 1 : piece(spans), half};
    atomic_long alone = 0;  /* the span counter when this thread does every span itself */
    if (pthread_mutex_trylock(&pool.caller) != 0) {  /* the pool is busy */
        run_spans(&job, &alone);
        return;
    }
    if (pool.workers < 0) start_workers();
    if (pool.workers == 0 || spans == 1) {
        run_spans(&job, &alone);
        pthread_mutex_unlock(&pool.caller);
        return;
    }
    pool.job = job;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.busy, pool.workers, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_spans(&job, &pool.next);
    while (atomic_load_explicit(&pool.busy, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&pool.caller);
}

/* A 2-D C-contiguous matrix of float32, or of float16 where `half_ok` is not NULL (it is set
 * to whether it is). */
static int float_matrix(PyObject *obj, Py_buffer *view, int writable, const char *name,
                        int *half_ok) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    int single = view->itemsize == 4 && strcmp(view->format, "f") == 0;
    int half = half_ok && view->itemsize == 2 && strcmp(view->format, "e") == 0;
    if (view->ndim != 2 || !(single || half)) {
        PyErr_Format(PyExc_ValueError, "%s must be a 2-D C-contiguous float32%s array", name,
                     half_ok ? " or float16" : "");
        PyBuffer_Release(view);
        return -1;
    }
    if (half_ok) *half_ok = half;
    return 0;
}

/* products(weight [O, K], rows [n, K], out [n, O]); n is 1, 2 or a multiple of GROUP; the
 * weight float32 or float16, rows and out float32 */
static PyObject *products(PyObject *self, PyObject *args) {
    PyObject *weight_obj, *rows_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOO", &weight_obj, &rows_obj, &out_obj)) return NULL;
    Py_buffer weight, rows, out;
    int half;
    if (float_matrix(weight_obj, &weight, 0, "weight", &half) < 0) return NULL;
    if (float_matrix(rows_obj, &rows, 0, "rows", NULL) < 0) {
        PyBuffer_Release(&weight);
        return NULL;
    }
    if (float_matrix(out_obj, &out, 1, "out", NULL) < 0) {
        PyBuffer_Release(&weight);
        PyBuffer_Release(&rows);
        return NULL;
    }
    Py_ssize_t outputs = weight.shape[0], width = weight.shape[1], n = rows.shape[0];
    PyObject *result = Py_None;
    if (rows.shape[1] != width || out.shape[0] != n || out.shape[1] != outputs) {
        PyErr_SetString(PyExc_ValueError, "products: shapes do not match");
        result = NULL;
    } else if (n > 2 && n % GROUP != 0) {
        PyErr_SetString(PyExc_ValueError, "products: rows must be 1, 2 or a multiple of 4");
        result = NULL;
    } else if (width == 0) {
        memset(out.buf, 0, (size_t)out.len);  /* empty sums */
    } else {
        Py_BEGIN_ALLOW_THREADS
        products_in_spans(weight.buf, half, rows.buf, out.buf, outputs, width, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&weight);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    Py_XINCREF(result);
    return result;
}

/* For tests: route half weights through the portable loops (False) or back (True, where the
 * CPU has F16C); returns whether the vector loops were in use. */
static PyObject *vector_half(PyObject *self, PyObject *arg) {
    (void)self;
    int wanted = PyObject_IsTrue(arg);
    if (wanted < 0) return NULL;
#ifdef HALF_AVX2
    int was = have_f16c;
    have_f16c = wanted && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
    return PyBool_FromLong(was);
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"products", products, METH_VARARGS,
     "products(weight, rows, out): out = rows @ weight.T in float32; 1, 2 or 4k rows; "
     "weight float32 or float16"},
    {"vector_half", vector_half, METH_O,
     "vector_half(enabled) -> was: half weights through the F16C loops or the portable ones"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_kernels(void) {
#ifdef HALF_AVX2
    __builtin_cpu_init();
    have_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
#endif
    pthread_atfork(NULL, NULL, forget_workers);
    return PyModule_Create(&module);
}
