"""specd's one compiled part: the few-row weight products (specd/cpu/_row_kernels.c).

Optional: without a C compiler the install still succeeds and specd uses numpy instead."""

from setuptools import Extension, setup

# `omp simd` reductions only (no OpenMP runtime: the threads are the module's own)
setup(
    ext_modules=[
        Extension(
            "specd.cpu._row_kernels",
            ["specd/cpu/_row_kernels.c"],
            extra_compile_args=["-O3", "-fopenmp-simd", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
