"""Set up MLX's backend on Linux: OpenBLAS for the CPU build, MLX's CUDA build on NVIDIA GPUs.

The mlx[cpu] wheel bundles reference BLAS (a 1024^2 fp32 matmul: ~350-800 ms); OpenBLAS
interposed with LD_PRELOAD does it in ~12-18 ms. `specd` re-executes itself once with it (under
the CUDA build this only speeds up MLX's CPU-stream ops, which bundle the same reference BLAS).

Where nvidia-smi reports a driver for CUDA 12 or newer, `install` also adds MLX's CUDA build for
the driver's CUDA major (mlx-cuda-13 from driver 580, else mlx-cuda-12; the installed mlx's own
version), checks that `import mlx.core` then runs on the GPU, and goes back to the CPU build if
it does not. mlx-cpu stays installed (specd depends on mlx[cpu]) although both wheels ship
mlx/lib/libmlx.so: pip overwrites files silently, so the one on disk is whichever wheel pip wrote
last. `install` makes it the CUDA one, and `specd` warns when a later pip run put the CPU one
back. An explicit --cuda choice is remembered in the environment for later `make setup` runs.

    python -m specd.platform install   # OpenBLAS; CUDA build on an NVIDIA GPU (make does this)
    python -m specd.platform install --cuda 13|12   # that CUDA build, whatever nvidia-smi says
    python -m specd.platform install --cuda none    # the CPU build (--cuda auto: detect again)
    python -m specd.platform exec -- CMD ...   # run CMD with the preload set
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

DEBIAN_PACKAGE = "libopenblas0-pthread"
_MARK = "SPECD_BLAS_CHECKED"  # set on re-exec so a process never loops


def host_description() -> dict:
    """This host's CPU model, cores and load average: timings on a lent machine depend on its
    CPU (Python, the host-side drafter heads) as well as its accelerator."""
    model = None
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), None)  # fmt: skip
    except OSError:  # not Linux
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # no load average here
        load = None
    return {"cpu": model or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "load": load}  # fmt: skip


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
    if (
        sys.platform == "linux"
        and openblas_path() is None
        and os.environ.get(_MARK) != "1"
        and not (_libmlx_owner() or "").startswith("mlx-cuda")
    ):
        print(
            "specd: OpenBLAS not found; MLX will use its slow reference BLAS on this CPU. "
            f"Install it with: apt-get install {DEBIAN_PACKAGE}  (or run `make setup`)",
            file=sys.stderr,
        )
        os.environ[_MARK] = "1"


def warn_if_cuda_build_shadowed() -> None:
    """Say so when MLX's CUDA build is installed but the CPU build's library is the one on disk."""
    cuda = [name for name in _CUDA_DISTS if _installed(name)]
    if cuda and not (_libmlx_owner() or "").startswith("mlx-cuda"):
        print(
            f"specd: {cuda[0]} is installed but mlx/lib/libmlx.so is the CPU build's (a later pip "
            "run rewrote it), so MLX runs on the CPU; `python -m specd.platform install` fixes it",
            file=sys.stderr,
        )


def ensure_fast_blas(argv: list[str]) -> None:
    """Re-exec `python -m specd argv` with OpenBLAS preloaded, once; warn if not possible."""
    if sys.platform == "linux" and os.environ.get(_MARK) != "1":
        warn_if_cuda_build_shadowed()
    if needs_reexec():
        os.execve(sys.executable, [sys.executable, "-m", "specd", *argv], blas_env())
    warn_if_slow_blas()


# --- MLX's CUDA build ------------------------------------------------------------------------

_CUDA_DISTS = ("mlx-cuda-13", "mlx-cuda-12")  # MLX's CUDA wheels; both ship mlx/lib/libmlx.so
_LIBMLX = "mlx/lib/libmlx.so"  # in mlx-cpu and in each mlx-cuda-N: pip lets the last one win
_SMI_FAILED = ("NVIDIA-SMI has failed", "No devices were found", "couldn't communicate")
# Smallest Linux driver branch for each CUDA major that MLX builds for (CUDA's release notes).
_MIN_DRIVER = {13: 580, 12: 525}
_CUDA_CHOICES = ("auto", "13", "12", "none")
_PROBE = "import mlx.core as mx; x = mx.ones((8, 8)); mx.eval(x @ x); print(mx.default_device())"


def nvidia_smi_versions(text: str) -> tuple[str | None, str | None]:
    """(driver version, CUDA version) from the header of plain `nvidia-smi` output."""
    driver = re.search(r"Driver Version:\s*([0-9][0-9.]*)", text)
    cuda = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", text)
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None)


def cuda_major_from_nvidia_smi(text: str) -> int | None:
    """The CUDA major of MLX's CUDA build for the driver `nvidia-smi` printed `text` about:
    13 where the driver supports CUDA 13 or newer, 12 where it supports 12.x, None where there
    is no usable driver (nvidia-smi failed, found no GPU, or the driver predates CUDA 12)."""
    if not text.strip() or any(marker in text for marker in _SMI_FAILED):
        return None
    driver, cuda = nvidia_smi_versions(text)
    if cuda is not None:
        major = int(cuda.split(".")[0])
    elif driver is not None and "CUDA Version:" not in text:  # header without CUDA's column
        branch = int(driver.split(".")[0])
        major = next((m for m, least in _MIN_DRIVER.items() if branch >= least), 0)
    else:  # e.g. "CUDA Version: N/A": the driver's CUDA library is not usable here
        return None
    if major >= 13:
        return 13  # a newer driver still runs CUDA 13 builds
    return 12 if major == 12 else None


def run_nvidia_smi(timeout: float = 10.0) -> str | None:
    """Plain `nvidia-smi` output, or None where it is missing, fails or hangs; never raises."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return out.stdout if out.returncode == 0 else None


def detect_cuda_major(timeout: float = 10.0) -> int | None:
    """The CUDA major (13 or 12) of MLX's build for this machine's NVIDIA driver, else None."""
    return cuda_major_from_nvidia_smi(run_nvidia_smi(timeout) or "")


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def mlx_version() -> str | None:
    try:
        return metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return None


def _libmlx_owner() -> str | None:
    """Which installed wheel (mlx-cpu, mlx-cuda-12, mlx-cuda-13) wrote the mlx/lib/libmlx.so
    now on disk: the one whose RECORD gives that file's size (the builds differ by ~100 MB)."""
    for name in (*_CUDA_DISTS, "mlx-cpu"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for entry in dist.files or ():
            if entry.as_posix() == _LIBMLX and entry.size is not None:
                path = Path(str(dist.locate_file(entry)))
                if path.is_file() and path.stat().st_size == entry.size:
                    return name
    return None


def _choice_file() -> Path:
    """Where an explicit `install --cuda` choice is kept: in this environment, beside pip's."""
    return Path(sys.prefix) / ".specd-mlx-cuda"


def _pip(*args: str) -> tuple[bool, str]:
    """Run pip of this interpreter's environment; (succeeded, its last line of output)."""
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        return False, str(exc)
    lines = (out.stderr.strip() or out.stdout.strip()).splitlines()
    return out.returncode == 0, lines[-1] if lines else ""


def _mlx_device(timeout: float = 300.0) -> tuple[str | None, str]:
    """('gpu' or 'cpu', '') from a fresh interpreter importing mlx.core, or (None, the error)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, str(exc)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"exit status {out.returncode}"
    return ("gpu" if "gpu" in out.stdout else "cpu"), ""


def _use_cpu_build(version: str) -> bool:
    """Remove MLX's CUDA wheels and write the CPU build's library back; True when MLX imports."""
    for name in _CUDA_DISTS:
        if _installed(name):
            _pip("uninstall", "-y", "-q", name)  # also deletes the shared mlx/lib/libmlx.so
    if _libmlx_owner() != "mlx-cpu":
        _pip("install", "-q", "--no-deps", "--force-reinstall", f"mlx-cpu=={version}")
    return _mlx_device()[0] is not None


def install_mlx_cuda(choice: str = "auto") -> None:
    """Put MLX's CUDA build in where it applies (see the module docstring); says what it did or
    why not, and never raises: MLX's CPU build stays usable whatever happens."""
    version = mlx_version()
    if version is None:
        print("MLX: mlx is not installed in this environment; nothing to set up")
        return
    if choice == "none":
        if any(_installed(name) for name in _CUDA_DISTS) or _libmlx_owner() != "mlx-cpu":
            ok = _use_cpu_build(version)
            print(f"MLX: CPU build {version} put back" if ok else "MLX: could not restore mlx-cpu")
        else:
            print("MLX: CPU build, as asked (--cuda none)")
        return
    if choice == "auto":
        smi = run_nvidia_smi()
        major = cuda_major_from_nvidia_smi(smi or "")
        driver, cuda = nvidia_smi_versions(smi or "")
        if major is None:
            if smi is None:
                why = "no nvidia-smi" if shutil.which("nvidia-smi") is None else "nvidia-smi failed"
            else:
                why = f"nvidia-smi: driver {driver}, CUDA {cuda}" if driver else "no NVIDIA GPU"
            print(f"MLX: CPU build ({why}; MLX's CUDA build needs a driver for CUDA >= 12)")
            return
        found = f"NVIDIA driver {driver} (CUDA {cuda})"
    else:
        major = int(choice)
        found = f"--cuda {major}"
    dist = f"mlx-cuda-{major}"
    spec = f"{dist}=={version}"
    if _libmlx_owner() == dist and _mlx_device()[0] == "gpu":
        print(f"MLX: CUDA {major} build ({spec}) already in place and running on the GPU")
        return
    print(f"MLX: {found}: installing {spec} and its NVIDIA libraries (1-2 GB) ...", flush=True)
    ok, said = _pip("install", "-q", spec)
    if not ok:
        print(f"MLX: installing {spec} failed ({said}); MLX stays on the CPU")
        if _libmlx_owner() != "mlx-cpu":  # pip stopped part-way: put the CPU library back
            _use_cpu_build(version)
        return
    for other in _CUDA_DISTS:  # one CUDA build at a time (their files overlap)
        if other != dist and _installed(other):
            _pip("uninstall", "-y", "-q", other)
    if _libmlx_owner() != dist:  # mlx-cpu's copy is the one on disk: write the CUDA one again
        _pip("install", "-q", "--no-deps", "--force-reinstall", spec)
    device, error = _mlx_device()
    if device == "gpu":
        print(f"MLX: CUDA {major} build installed; mlx.core runs on the GPU")
        return
    why = error or f"mlx.core's default device is {device}"
    restored = _use_cpu_build(version)
    print(
        f"MLX: the CUDA {major} build did not run ({why}); "
        + ("went back to the CPU build" if restored else "could not restore the CPU build")
    )


def install_openblas() -> None:
    """Best effort apt-get install; says what happened and never fails the setup."""
    if openblas_path():
        print(f"BLAS: OpenBLAS found at {openblas_path()}")
        return
    apt = shutil.which("apt-get")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if apt is None or sudo is None:
        print(
            f"BLAS: could not install OpenBLAS (need apt-get and root); MLX on CPU will be "
            f"slow. Install the package {DEBIAN_PACKAGE} or your distribution's OpenBLAS."
        )
        return
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


def _cuda_choice(asked: str | None) -> str:
    """The --cuda choice to act on: asked is remembered in this environment ('auto' forgets);
    None (no --cuda) takes the remembered one, else 'auto'."""
    path = _choice_file()
    try:
        if asked is None:
            remembered = path.read_text().strip() if path.is_file() else ""
            if remembered in _CUDA_CHOICES:
                print(f"MLX: as asked earlier, --cuda {remembered} (--cuda auto to detect again)")
                return remembered
        elif asked == "auto":
            path.unlink(missing_ok=True)
        else:
            path.write_text(asked + "\n")
    except OSError:
        pass
    return asked or "auto"


def install(cuda: str | None = None) -> int:
    """`make setup`'s platform step: OpenBLAS, then MLX's CUDA build where an NVIDIA driver is
    found. cuda: '13', '12', 'none' or 'auto' (remembered); None: the remembered choice or auto.
    Says what happened; never fails the setup."""
    if sys.platform != "linux":
        print("BLAS: not Linux, MLX uses the platform's own (Accelerate on macOS)")
        if cuda in ("12", "13"):
            print("MLX: its CUDA build is for Linux only")
        return 0
    install_openblas()
    try:
        install_mlx_cuda(_cuda_choice(cuda))
    except Exception as exc:  # set-up goes on with the CPU build
        print(f"MLX: setting up the CUDA build failed ({exc!r}); MLX stays on the CPU")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        rest = argv[1:]
        if rest == []:
            return install()
        if len(rest) == 2 and rest[0] == "--cuda" and rest[1] in _CUDA_CHOICES:
            return install(rest[1])
        if len(rest) == 1 and rest[0].startswith("--cuda=") and rest[0][7:] in _CUDA_CHOICES:
            return install(rest[0][7:])
        print("usage: python -m specd.platform install [--cuda 13|12|none|auto]", file=sys.stderr)
        return 2
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
