/* Products of a few input rows with one float32 weight matrix, reading the weights once.
 *
 * specd.models.row_products explains why; this is the compiled part. Built by pip with the
 * package (setup.py) when a C compiler is present; without it specd falls back to numpy.
 * OpenMP threads share the weight rows; the loops are handed out in pieces (dynamic
 * schedule) so a thread the OS lends to another process does not hold up the product.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* AVX2 + FMA where the CPU has them, plain x86-64 otherwise, chosen when the module loads */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

#define GROUP 4                  /* input rows per pass over a weight row */
#define TILE_BYTES (256 << 10)   /* weight rows walked once per group: well inside L2 */
#define PIECES 16                /* pieces each parallel loop is cut into */

static Py_ssize_t piece(Py_ssize_t iterations) {
    Py_ssize_t p = iterations / PIECES;
    return p > 0 ? p : 1;
}

/* The vector loops live in their own functions: target_clones does not reach the bodies
 * that OpenMP outlines from a parallel loop. */
VECTOR_CLONES
static void one_row_span(const float *weight, const float *row, float *out, Py_ssize_t width,
                         Py_ssize_t first, Py_ssize_t last) {
    for (Py_ssize_t o = first; o < last; o++) {
        const float *w = weight + o * width;
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (Py_ssize_t k = 0; k < width; k++) a += w[k] * row[k];
        out[o] = a;
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

/* Weight rows are split into spans: for one input row PIECES spans, for groups of four
 * spans of TILE_BYTES, each read from memory once and kept in L2 while every group of
 * input rows (in L1) passes over it. */
static void products_in_spans(const float *weight, const float *rows, float *out,
                              Py_ssize_t outputs, Py_ssize_t width, Py_ssize_t n) {
    Py_ssize_t span = n == 1 ? piece(outputs) : TILE_BYTES / (width * (Py_ssize_t)sizeof(float));
    if (span < 1) span = 1;
    Py_ssize_t spans = (outputs + span - 1) / span;
    int chunk = n == 1 ? 1 : (int)piece(spans);
#pragma omp parallel for schedule(dynamic, chunk)
    for (Py_ssize_t t = 0; t < spans; t++) {
        Py_ssize_t first = t * span, last = first + span < outputs ? first + span : outputs;
        if (n == 1)
            one_row_span(weight, rows, out, width, first, last);
        else
            four_rows_span(weight, rows, out, outputs, width, n, first, last);
    }
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

/* products(weight [O, K], rows [n, K], out [n, O]); n == 1 or a multiple of GROUP */
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
    } else if (n != 1 && n % GROUP != 0) {
        PyErr_SetString(PyExc_ValueError, "products: rows must be 1 or a multiple of 4");
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
     "products(weight, rows, out): out = rows @ weight.T, float32, 1 or 4k rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_kernels(void) { return PyModule_Create(&module); }
