/* Products of a few input rows with one float32 weight matrix, reading the weights once.
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

#define GROUP 4                  /* input rows per pass over a weight row */
#define TILE_BYTES (256 << 10)   /* weight rows walked once per group: well inside L2 */
#define PIECES 16                /* pieces each parallel loop is cut into */

#define AHEAD 4                  /* weight rows fetched ahead of their use */

/* The hardware prefetcher alone left the four-row loop ~15 % short of memory speed. */
static inline void prefetch_row(const float *row, Py_ssize_t width) {
    for (Py_ssize_t k = 0; k < width; k += 64 / sizeof(float)) __builtin_prefetch(row + k);
}

static Py_ssize_t piece(Py_ssize_t iterations) {
    Py_ssize_t p = iterations / PIECES;
    return p > 0 ? p : 1;
}

VECTOR_CLONES
static void one_row_span(const float *weight, const float *row, float *out, Py_ssize_t width,
                         Py_ssize_t first, Py_ssize_t last) {
    for (Py_ssize_t o = first; o < last; o++) {
        const float *w = weight + o * width;
        if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width);
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (Py_ssize_t k = 0; k < width; k++) a += w[k] * row[k];
        out[o] = a;
    }
}

/* Two input rows (a verify of one draft): half the four-row loop's arithmetic. */
VECTOR_CLONES
static void two_rows_span(const float *weight, const float *rows, float *out, Py_ssize_t outputs,
                          Py_ssize_t width, Py_ssize_t first, Py_ssize_t last) {
    const float *x0 = rows, *x1 = rows + width;
    for (Py_ssize_t o = first; o < last; o++) {
        const float *w = weight + o * width;
        if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width);
        float a = 0.0f, b = 0.0f;
#pragma omp simd reduction(+ : a, b)
        for (Py_ssize_t k = 0; k < width; k++) {
            a += w[k] * x0[k];
            b += w[k] * x1[k];
        }
        out[o] = a;
        out[outputs + o] = b;
    }
}

VECTOR_CLONES
static void four_rows_span(const float *weight, const float *rows, float *out,
                           Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n,
                           Py_ssize_t first, Py_ssize_t last) {
    for (Py_ssize_t i = 0; i < n; i += GROUP) {
        const float *x0 = rows + i * width, *x1 = x0 + width, *x2 = x1 + width,
                    *x3 = x2 + width;
        for (Py_ssize_t o = first; o < last; o++) {
            const float *w = weight + o * width;
            if (o + AHEAD < last) prefetch_row(w + AHEAD * width, width);
            float a = 0.0f, b = 0.0f, c = 0.0f, d = 0.0f;
#pragma omp simd reduction(+ : a, b, c, d)
            for (Py_ssize_t k = 0; k < width; k++) {
                float wk = w[k];
                a += wk * x0[k];
                b += wk * x1[k];
                c += wk * x2[k];
                d += wk * x3[k];
            }
            out[i * outputs + o] = a;
            out[(i + 1) * outputs + o] = b;
            out[(i + 2) * outputs + o] = c;
            out[(i + 3) * outputs + o] = d;
        }
    }
}

/* Weight rows are split into spans: for one or two input rows PIECES spans, for groups of four
 * spans of TILE_BYTES, each read from memory once and kept in L2 while every group of
 * input rows (in L1) passes over it. Threads claim `chunk` spans at a time. */
typedef struct {
    const float *weight, *rows;
    float *out;
    Py_ssize_t outputs, width, n, span, spans, chunk;
} Job;

static void run_spans(const Job *job, atomic_long *next) {
    for (;;) {
        Py_ssize_t t = atomic_fetch_add_explicit(next, job->chunk, memory_order_relaxed);
        if (t >= job->spans) return;
        Py_ssize_t stop = t + job->chunk < job->spans ? t + job->chunk : job->spans;
        for (; t < stop; t++) {
            Py_ssize_t first = t * job->span;
            Py_ssize_t last = first + job->span < job->outputs ? first + job->span : job->outputs;
            if (job->n == 1)
                one_row_span(job->weight, job->rows, job->out, job->width, first, last);
            else if (job->n == 2)
                two_rows_span(job->weight, job->rows, job->out, job->outputs, job->width, first,
                              last);
            else
                four_rows_span(job->weight, job->rows, job->out, job->outputs, job->width,
                               job->n, first, last);
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

static void products_in_spans(const float *weight, const float *rows, float *out,
                              Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n) {
    Py_ssize_t span = n <= 2 ? piece(outputs) : TILE_BYTES / (width * (Py_ssize_t)sizeof(float));
    if (span < 1) span = 1;
    Py_ssize_t spans = (outputs + span - 1) / span;
    Job job = {weight, rows, out, outputs, width, n, span, spans, n <= 2 ? 1 : piece(spans)};
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

static int float_matrix(PyObject *obj, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->ndim != 2 || view->itemsize != 4 || strcmp(view->format, "f") != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a 2-D C-contiguous float32 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* products(weight [O, K], rows [n, K], out [n, O]); n is 1, 2 or a multiple of GROUP */
static PyObject *products(PyObject *self, PyObject *args) {
    PyObject *weight_obj, *rows_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "OOO", &weight_obj, &rows_obj, &out_obj)) return NULL;
    Py_buffer weight, rows, out;
    if (float_matrix(weight_obj, &weight, 0, "weight") < 0) return NULL;
    if (float_matrix(rows_obj, &rows, 0, "rows") < 0) {
        PyBuffer_Release(&weight);
        return NULL;
    }
    if (float_matrix(out_obj, &out, 1, "out") < 0) {
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
        products_in_spans(weight.buf, rows.buf, out.buf, outputs, width, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&weight);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"products", products, METH_VARARGS,
     "products(weight, rows, out): out = rows @ weight.T, float32, 1, 2 or 4k rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_kernels(void) {
    pthread_atfork(NULL, NULL, forget_workers);
    return PyModule_Create(&module);
}
