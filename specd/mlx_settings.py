"""Process-wide MLX settings specd makes before any kernel runs (`apply`, from `specd`'s entry).

Kernel cache: MLX's CUDA build compiles kernels at first use (NVRTC; on an H200 about 15 s per
kernel module) and keeps them under the system's temporary folder, which a reboot or a fresh
container empties. specd points MLX at a folder of its own, one per MLX version (kernels of one
version are not valid for another), unless `MLX_PTX_CACHE_DIR` is already set.

Full float32: by default MLX runs float32 products of more than one row in TF32 where the
hardware has it (NVIDIA since Ampere), with a 10-bit mantissa, while one-row products (a decode
step) stay float32. A verify of k tokens and k decode steps then round differently, enough to
flip near-ties in greedy output (measured on an H200: logits apart by up to 0.026). specd keeps
float32 whole (`MLX_ENABLE_TF32=0`) unless the variable is already set; a forward of a few rows
is launch-bound, so this costs no measurable time there.
"""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_CACHE_VARIABLE = "MLX_PTX_CACHE_DIR"
TF32_VARIABLE = "MLX_ENABLE_TF32"


def default_kernel_cache() -> Path:
    from specd.platform import mlx_version

    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specd" / "mlx-kernels" / (mlx_version() or "unknown")


def use_persistent_kernel_cache() -> Path | None:
    """Set MLX's kernel cache to specd's folder if none was chosen; the folder in use, or None
    when it cannot be created (MLX then keeps its own default)."""
    chosen = os.environ.get(KERNEL_CACHE_VARIABLE)
    if chosen:
        return Path(chosen)
    folder = default_kernel_cache()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ[KERNEL_CACHE_VARIABLE] = str(folder)
    return folder


def apply() -> None:
    """Both settings, for this process and the services it starts (they inherit them)."""
    use_persistent_kernel_cache()
    os.environ.setdefault(TF32_VARIABLE, "0")
