"""Give MLX an optimized BLAS on Linux.

The mlx[cpu] wheel bundles reference BLAS (a 1024^2 fp32 matmul: ~350-800 ms); OpenBLAS
interposed with LD_PRELOAD does it in ~12-18 ms. `specd` re-executes itself once with it.

    python -m specd.platform install   # apt-get install OpenBLAS if possible (make does this)
    python -m specd.platform exec -- CMD ...   # run CMD with the preload set
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

DEBIAN_PACKAGE = "libopenblas0-pthread"
_MARK = "SPECD_BLAS_CHECKED"  # set on re-exec so a process never loops


def openblas_path() -> str | None:
    """The OpenBLAS build of libblas.so.3 (Debian/Ubuntu layout), if installed."""
    if sys.platform != "linux":
        return None
    arch = platform.machine()
    triplets = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
    candidates = [
        f"/usr/lib/{triplets.get(arch, arch + '-linux-gnu')}/openblas-pthread/libblas.so.3",
        "/usr/lib64/openblas-pthreads/libblas.so.3",
        "/usr/lib/openblas-pthread/libblas.so.3",
    ]
    return next((c for c in candidates if Path(c).is_file()), None)


def blas_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of env with OpenBLAS preloaded where that applies."""
    env = dict(os.environ if env is None else env)
    lib = openblas_path()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_MARK] = "1"
    return env


def set_blas_threads(count: int) -> bool:
    """Size this process's OpenBLAS thread pool; False when OpenBLAS is not the loaded BLAS."""
    import ctypes

    try:
        setter = ctypes.CDLL(None).openblas_set_num_threads
    except (AttributeError, OSError):
        return False
    setter(ctypes.c_int(count))
    return True


def limit_numpy_blas_threads(count: int) -> int:
    """Size the thread pool of the BLAS numpy was built with (not MLX's); returns how many
    pools were resized (0 where numpy's BLAS has none, e.g. Accelerate)."""
    import numpy as np
    from threadpoolctl import ThreadpoolController

    numpy_dir = Path(np.__file__).resolve().parent
    bundled = {numpy_dir, numpy_dir.parent / "numpy.libs", numpy_dir / ".dylibs"}
    resized = 0
    for lib in ThreadpoolController().lib_controllers:
        if lib.user_api == "blas" and Path(lib.filepath).resolve().parent in bundled:
            lib.set_num_threads(count)
            resized += 1
    return resized


def needs_reexec() -> bool:
    return (
        sys.platform == "linux"
        and os.environ.get(_MARK) != "1"
        and "mlx.core" not in sys.modules
        and openblas_path() is not None
    )


def warn_if_slow_blas() -> None:
    if sys.platform == "linux" and openblas_path() is None and os.environ.get(_MARK) != "1":
        print(
            "specd: OpenBLAS not found; MLX will use its slow reference BLAS on this CPU. "
            f"Install it with: apt-get install {DEBIAN_PACKAGE}  (or run `make setup`)",
            file=sys.stderr,
        )
        os.environ[_MARK] = "1"


def ensure_fast_blas(argv: list[str]) -> None:
    """Re-exec `python -m specd argv` with OpenBLAS preloaded, once; warn if not possible."""
    if needs_reexec():
        os.execve(sys.executable, [sys.executable, "-m", "specd", *argv], blas_env())
    warn_if_slow_blas()


def install() -> int:
    """Best effort apt-get install; says what happened and never fails the setup."""
    if sys.platform != "linux":
        print("BLAS: not Linux, MLX uses the platform's own (Accelerate on macOS)")
        return 0
    if openblas_path():
        print(f"BLAS: OpenBLAS found at {openblas_path()}")
        return 0
    apt = shutil.which("apt-get")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if apt is None or sudo is None:
        print(
            f"BLAS: could not install OpenBLAS (need apt-get and root); MLX on CPU will be "
            f"slow. Install the package {DEBIAN_PACKAGE} or your distribution's OpenBLAS."
        )
        return 0
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = [*sudo, apt, "install", "-y", "-q", DEBIAN_PACKAGE]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run([*sudo, apt, "update", "-q"], env=env, capture_output=True)
        subprocess.run(cmd, env=env, capture_output=True)
    found = openblas_path()
    print(
        f"BLAS: OpenBLAS installed at {found}"
        if found
        else f"BLAS: installing {DEBIAN_PACKAGE} failed; MLX on CPU will be slow"
    )
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        return install()
    if argv[:1] == ["exec"]:
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not cmd:
            print("usage: python -m specd.platform exec -- CMD ...", file=sys.stderr)
            return 2
        warn_if_slow_blas()
        os.execvpe(cmd[0], cmd, blas_env())
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
