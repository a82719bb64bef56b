"""The one compiled part of specd: the verifier's few-row weight products (specd/_row_kernels.c).

Optional: without a C compiler the install still succeeds and specd uses numpy instead."""

import sys

from setuptools import Extension, setup

# OpenMP threads and `omp simd` reductions; Apple's clang has no OpenMP runtime, only simd
openmp = ["-fopenmp-simd"] if sys.platform == "darwin" else ["-fopenmp"]
setup(
    ext_modules=[
        Extension(
            "specd._row_kernels",
            ["specd/_row_kernels.c"],
            extra_compile_args=["-O3", *openmp],
            extra_link_args=[] if sys.platform == "darwin" else ["-fopenmp"],
            optional=True,
        )
    ]
)
