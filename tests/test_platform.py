import subprocess
import sys

from specd import platform


def test_blas_env_preloads_openblas_when_present(monkeypatch):
    monkeypatch.setattr(platform, "openblas_path", lambda: "/opt/libblas.so.3")
    env = platform.blas_env({"LD_PRELOAD": "/x.so"})
    assert env["LD_PRELOAD"] == "/opt/libblas.so.3:/x.so"
    assert platform.blas_env(env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # not added twice


def test_no_preload_without_openblas(monkeypatch):
    monkeypatch.setattr(platform, "openblas_path", lambda: None)
    assert "LD_PRELOAD" not in platform.blas_env({})


def test_specd_command_runs_with_fast_blas_where_available():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specd.platform",
            "exec",
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ.get('LD_PRELOAD', ''))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    expected = platform.openblas_path()
    assert (expected in out) if expected else out == ""


def test_blas_threads_can_be_set_where_openblas_is_loaded():
    code = (
        "import ctypes, mlx.core\n"
        "from specd.platform import set_blas_threads\n"
        "ok = set_blas_threads(1)\n"
        "print(ok, ctypes.CDLL(None).openblas_get_num_threads() if ok else -1)\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "specd.platform", "exec", "--", sys.executable, "-c", code],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if platform.openblas_path() is None:
        assert out == ["False", "-1"]
    else:
        assert out == ["True", "1"]


def test_the_host_is_described_by_its_cpu_model_cores_and_load():
    import os

    from specd import platform as host_platform

    described = host_platform.host_description()
    assert described["cores"] == os.cpu_count()
    assert len(described["load"]) == 3 and all(x >= 0 for x in described["load"])
    assert described["cpu"]
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), None)  # fmt: skip
    except OSError:
        model = None
    if model is not None:  # Linux on x86-64 names it; elsewhere the platform's name stands
        assert described["cpu"] == model


def test_a_host_without_a_load_average_is_still_described(monkeypatch):
    from specd import platform as host_platform

    def unavailable():
        raise OSError("no load average in this sandbox")

    monkeypatch.setattr(host_platform.os, "getloadavg", unavailable)
    assert host_platform.host_description()["load"] is None
