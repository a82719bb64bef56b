"""MLX's CUDA build at set-up: nvidia-smi parsing and the pip commands install() runs.

No network, no GPU: subprocess.run is replaced by a fake that plays nvidia-smi, pip and the
probe interpreter, and keeps which wheel wrote mlx/lib/libmlx.so the way pip does (last wins).
"""

import subprocess
import sys

import pytest

from specd import platform

# seen on an H200 machine (driver 580.159.04)
SMI_580 = """\
Tue Dec  1 19:13:50 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA H200                    On  |   00000000:00:06.0 Off |                    0 |
| N/A   36C    P0             79W /  700W |       0MiB / 143771MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+

+-----------------------------------------------------------------------------------------+
| Processes:                                                                              |
|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |
|        ID   ID                                                               Usage      |
|=========================================================================================|
|  No running processes found                                                             |
+-----------------------------------------------------------------------------------------+
"""

SMI_550 = """\
Tue Apr  2 09:15:40 2024
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA A10G                    On  |   00000000:00:1E.0 Off |                    0 |
|  0%   24C    P8              9W /  300W |       1MiB /  23028MiB |      0%      Default |
|                                         |                        |                  N/A |
+-----------------------------------------+------------------------+----------------------+
"""

SMI_470 = SMI_550.replace("550.54.15", "470.82.01").replace("Version: 12.4", "Version: 11.4")

SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running.\n"
)


@pytest.mark.parametrize(
    ("text", "major"),
    [
        (SMI_580, 13),
        (SMI_580.replace("CUDA Version: 13.0", "CUDA Version: 13.1"), 13),
        (SMI_580.replace("CUDA Version: 13.0", "CUDA Version: 14.2"), 13),  # newer runs 13
        (SMI_550, 12),
        (SMI_550.replace("CUDA Version: 12.4", "CUDA Version: 12.0"), 12),
        (SMI_470, None),  # CUDA 11: MLX has no build for it
        (SMI_NO_DRIVER, None),
        ("No devices were found\n", None),
        ("", None),
        ("   \n", None),
        (SMI_550.replace("CUDA Version: 12.4", "CUDA Version: N/A "), None),
    ],
)
def test_cuda_major_from_nvidia_smi(text, major):
    assert platform.cuda_major_from_nvidia_smi(text) == major


def test_nvidia_smi_versions():
    assert platform.nvidia_smi_versions(SMI_580) == ("580.159.04", "13.0")
    assert platform.nvidia_smi_versions(SMI_550) == ("550.54.15", "12.4")
    assert platform.nvidia_smi_versions(SMI_NO_DRIVER) == (None, None)


def test_no_nvidia_smi_means_no_cuda(monkeypatch):
    monkeypatch.setattr(platform.shutil, "which", lambda name, *a, **k: None)
    ran = []
    monkeypatch.setattr(platform.subprocess, "run", lambda *a, **k: ran.append(a))
    assert platform.run_nvidia_smi() is None
    assert platform.detect_cuda_major() is None
    assert ran == []


def test_nvidia_smi_missing_from_an_empty_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert platform.detect_cuda_major() is None


def test_failing_or_hanging_nvidia_smi_means_no_cuda(monkeypatch):
    monkeypatch.setattr(platform.shutil, "which", lambda name, *a, **k: "/usr/bin/nvidia-smi")

    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 9, SMI_NO_DRIVER, "")

    monkeypatch.setattr(platform.subprocess, "run", failing)
    assert platform.run_nvidia_smi() is None
    assert platform.detect_cuda_major() is None

    def hanging(cmd, **kwargs):
        assert kwargs["timeout"] <= 30
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(platform.subprocess, "run", hanging)
    assert platform.detect_cuda_major() is None

    def unrunnable(cmd, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(platform.subprocess, "run", unrunnable)
    assert platform.detect_cuda_major() is None


def test_working_nvidia_smi_is_read(monkeypatch):
    monkeypatch.setattr(platform.shutil, "which", lambda name, *a, **k: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        platform.subprocess,
        "run",
        lambda cmd, **k: subprocess.CompletedProcess(cmd, 0, SMI_550, ""),
    )
    assert platform.detect_cuda_major() == 12


class FakeMachine:
    """nvidia-smi, pip and a probe interpreter, played; libmlx.so goes to the last wheel written."""

    def __init__(self, smi, installed=("mlx-cpu",), owner="mlx-cpu", gpu_works=True):
        self.smi = smi
        self.installed = set(installed)
        self.owner = owner
        self.gpu_works = gpu_works
        self.calls = []

    @property
    def pip_calls(self):
        return [c[3:] for c in self.calls if c[:3] == [sys.executable, "-m", "pip"]]

    def run(self, cmd, **kwargs):
        cmd = list(cmd)
        self.calls.append(cmd)
        if cmd[0].endswith("nvidia-smi"):
            if self.smi is None:
                raise FileNotFoundError(cmd[0])
            return subprocess.CompletedProcess(cmd, 0, self.smi, "")
        if cmd[:3] == [sys.executable, "-m", "pip"]:
            return self.pip(cmd, cmd[3:])
        if cmd[:2] == [sys.executable, "-c"]:
            if self.owner is None:
                return subprocess.CompletedProcess(cmd, 1, "", "ImportError: libmlx.so")
            if self.owner.startswith("mlx-cuda") and not self.gpu_works:
                return subprocess.CompletedProcess(cmd, 1, "", "RuntimeError: no CUDA device")
            device = "gpu" if self.owner.startswith("mlx-cuda") else "cpu"
            return subprocess.CompletedProcess(cmd, 0, f"Device({device}, 0)\n", "")
        raise AssertionError(f"unexpected command {cmd}")

    def pip(self, cmd, args):
        name = args[-1].split("==")[0]
        if args[0] == "install":
            if name not in self.installed or "--force-reinstall" in args:
                self.installed.add(name)
                self.owner = name  # pip writes the wheel's files over whatever was there
        elif args[0] == "uninstall":
            self.installed.discard(name)
            if self.owner is not None:
                self.owner = None  # the shared libmlx.so goes with either wheel
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def owner_of_libmlx(self):
        return self.owner if self.owner in self.installed else None


@pytest.fixture
def machine(monkeypatch, tmp_path):
    def make(smi, **kwargs):
        fake = FakeMachine(smi, **kwargs)
        monkeypatch.setattr(platform.sys, "platform", "linux")
        monkeypatch.setattr(platform, "openblas_path", lambda: "/usr/lib/libblas.so.3")
        monkeypatch.setattr(
            platform.shutil,
            "which",
            lambda name, *a, **k: "/usr/bin/nvidia-smi" if smi is not None else None,
        )
        monkeypatch.setattr(platform.subprocess, "run", fake.run)
        monkeypatch.setattr(platform, "mlx_version", lambda: "0.32.4")
        monkeypatch.setattr(platform, "_installed", lambda name: name in fake.installed)
        monkeypatch.setattr(platform, "_libmlx_owner", fake.owner_of_libmlx)
        monkeypatch.setattr(platform, "_choice_file", lambda: tmp_path / "choice")
        return fake

    return make


def test_install_on_a_cuda13_driver_installs_mlx_cuda_13(machine, capsys):
    fake = machine(SMI_580)
    assert platform.install() == 0
    assert fake.pip_calls == [["install", "-q", "mlx-cuda-13==0.32.4"]]
    assert fake.owner == "mlx-cuda-13" and "mlx-cpu" in fake.installed
    out = capsys.readouterr().out
    assert "580.159.04" in out and "runs on the GPU" in out


def test_install_on_a_cuda12_driver_installs_mlx_cuda_12(machine):
    fake = machine(SMI_550)
    platform.install()
    assert fake.pip_calls == [["install", "-q", "mlx-cuda-12==0.32.4"]]
    assert fake.owner == "mlx-cuda-12"


@pytest.mark.parametrize("smi", [None, SMI_NO_DRIVER, "", SMI_470])
def test_without_a_usable_gpu_no_cuda_install_is_attempted(machine, capsys, smi):
    fake = machine(smi)
    assert platform.install() == 0
    assert fake.pip_calls == []
    assert not any(c[:2] == [sys.executable, "-c"] for c in fake.calls)
    assert fake.owner == "mlx-cpu"
    assert "MLX: CPU build" in capsys.readouterr().out


def test_cpu_library_written_over_the_cuda_one_is_repaired(machine):
    # mlx-cuda-13 installed earlier, then a pip run put mlx-cpu's libmlx.so back on top
    fake = machine(SMI_580, installed=("mlx-cpu", "mlx-cuda-13"), owner="mlx-cpu")
    platform.install()
    assert fake.pip_calls == [
        ["install", "-q", "mlx-cuda-13==0.32.4"],  # already satisfied: pip writes nothing
        ["install", "-q", "--no-deps", "--force-reinstall", "mlx-cuda-13==0.32.4"],
    ]
    assert fake.owner == "mlx-cuda-13"


def test_cuda_build_in_place_is_left_alone(machine, capsys):
    fake = machine(SMI_580, installed=("mlx-cpu", "mlx-cuda-13"), owner="mlx-cuda-13")
    platform.install()
    assert fake.pip_calls == []
    assert "already in place" in capsys.readouterr().out


def test_switching_cuda_major_removes_the_other_build(machine):
    fake = machine(SMI_580, installed=("mlx-cpu", "mlx-cuda-12"), owner="mlx-cuda-12")
    platform.install()
    assert fake.pip_calls == [
        ["install", "-q", "mlx-cuda-13==0.32.4"],
        ["uninstall", "-y", "-q", "mlx-cuda-12"],
        ["install", "-q", "--no-deps", "--force-reinstall", "mlx-cuda-13==0.32.4"],
    ]
    assert fake.installed == {"mlx-cpu", "mlx-cuda-13"} and fake.owner == "mlx-cuda-13"


def test_cuda_build_that_does_not_run_is_replaced_by_the_cpu_build(machine, capsys):
    fake = machine(SMI_580, gpu_works=False)
    assert platform.install() == 0
    assert fake.pip_calls == [
        ["install", "-q", "mlx-cuda-13==0.32.4"],
        ["uninstall", "-y", "-q", "mlx-cuda-13"],
        ["install", "-q", "--no-deps", "--force-reinstall", "mlx-cpu==0.32.4"],
    ]
    assert fake.installed == {"mlx-cpu"} and fake.owner == "mlx-cpu"
    assert "went back to the CPU build" in capsys.readouterr().out


def test_failed_pip_install_keeps_the_cpu_build(machine, capsys):
    fake = machine(SMI_580)
    real = fake.pip
    fake.pip = lambda cmd, args: (
        subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
        if args[0] == "install"
        else real(cmd, args)
    )
    assert platform.install() == 0
    assert fake.pip_calls == [["install", "-q", "mlx-cuda-13==0.32.4"]]
    assert fake.owner == "mlx-cpu"
    assert "No matching distribution" in capsys.readouterr().out


def test_explicit_cuda_choice_overrides_detection_and_is_remembered(machine):
    fake = machine(None)  # no nvidia-smi at all
    platform.install("12")
    assert fake.pip_calls == [["install", "-q", "mlx-cuda-12==0.32.4"]]
    assert not any(c[0].endswith("nvidia-smi") for c in fake.calls)
    fake.calls.clear()
    platform.install()  # a later `make setup`: keeps the choice, nothing to do
    assert fake.pip_calls == []
    assert fake.owner == "mlx-cuda-12"


def test_cuda_none_restores_the_cpu_build_and_sticks(machine):
    fake = machine(SMI_580, installed=("mlx-cpu", "mlx-cuda-13"), owner="mlx-cuda-13")
    platform.install("none")
    assert fake.pip_calls == [
        ["uninstall", "-y", "-q", "mlx-cuda-13"],
        ["install", "-q", "--no-deps", "--force-reinstall", "mlx-cpu==0.32.4"],
    ]
    assert fake.owner == "mlx-cpu"
    fake.calls.clear()
    platform.install()  # remembered: a GPU is there, but no CUDA install
    assert fake.pip_calls == []
    platform.install("auto")  # forgets the choice and detects again
    assert fake.pip_calls == [["install", "-q", "mlx-cuda-13==0.32.4"]]


def test_main_parses_the_cuda_option(monkeypatch):
    asked = []
    monkeypatch.setattr(platform, "install", lambda cuda=None: asked.append(cuda) or 0)
    assert platform.main(["install"]) == 0
    assert platform.main(["install", "--cuda", "13"]) == 0
    assert platform.main(["install", "--cuda=none"]) == 0
    assert platform.main(["install", "--cuda", "11"]) == 2
    assert asked == [None, "13", "none"]


def test_libmlx_owner_matches_the_file_size_in_record(monkeypatch, tmp_path):
    lib = tmp_path / "mlx" / "lib" / "libmlx.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"x" * 300)

    class Entry:
        def __init__(self, size):
            self.size = size

        def as_posix(self):
            return "mlx/lib/libmlx.so"

    class Dist:
        def __init__(self, size):
            self.files = [Entry(size)]

        def locate_file(self, entry):
            return lib

    sizes = {"mlx-cpu": 100, "mlx-cuda-13": 300}

    def distribution(name):
        if name not in sizes:
            raise platform.metadata.PackageNotFoundError(name)
        return Dist(sizes[name])

    monkeypatch.setattr(platform.metadata, "distribution", distribution)
    assert platform._libmlx_owner() == "mlx-cuda-13"
    lib.write_bytes(b"x" * 100)
    assert platform._libmlx_owner() == "mlx-cpu"
    lib.unlink()
    assert platform._libmlx_owner() is None
