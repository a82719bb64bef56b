"""Start services as separate processes on this machine and wait until they are healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.platform import blas_env


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: all held open together, so none is handed out twice (one
    at a time, a port whose service has not bound it yet can come back)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def spawn_together(stacks: list[Stack]) -> None:
    """Spawn the services of stacks on one host at once, their ports chosen together (a port
    another stack's service has not bound yet could otherwise be handed out again); each
    stack still to `wait_healthy`."""
    unset = [(stack, name) for stack in stacks for name in stack.unset_ports()]
    ports = iter(free_ports(len(unset), stacks[0].host if stacks else "127.0.0.1"))
    for stack, name in unset:
        stack.ports = {**stack.ports, name: next(ports)}
    for stack in stacks:
        stack.spawn()


def health_status(
    address: str, timeout_s: float = 2.0, credentials: grpc.ChannelCredentials | None = None
) -> int | None:
    """SERVING/NOT_SERVING/..., or None when nothing answers."""
    channel = (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s).status
        except grpc.RpcError:
            return None


def process_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # utime and stime, the 14th and 15th fields of stat(5), counted after the name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class ServiceProcess:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path | None = None

    def cpu_seconds(self) -> float | None:
        """CPU time the process has used so far (user and system), where the OS tells it
        (Linux's /proc); None elsewhere or once the process is gone."""
        return process_cpu_seconds(self.process.pid)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(
        self, timeout_s: float, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.process.returncode}\n{self.log_tail()}"
                )
            status = health_status(self.address, credentials=credentials)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.3)
        raise TimeoutError(
            f"{self.name} at {self.address} not healthy after {timeout_s:.0f}s\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def spawn(
    name: str,
    args: list[str],
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """`python -m specd serve NAME --host H --port P ARGS`; output to log_dir/NAME.log if given."""
    port = port or free_port(host)
    return start_service(
        name, ["--host", host, "--port", str(port), *args], f"{host}:{port}", log_dir, env
    )


def start_service(
    name: str,
    args: list[str],
    address: str,
    log_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """`python -m specd serve NAME ARGS`, reachable at `address` once healthy; env: the
    process's environment (default: this one with OpenBLAS preloaded where that applies)."""
    cmd = [sys.executable, "-m", "specd", "serve", name, *args]
    log_path = None
    out = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        out = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    process = subprocess.Popen(cmd, stdout=out, stderr=out, env=env or blas_env())
    if out is not None:
        out.close()
    return ServiceProcess(name, address, process, log_path)


@dataclass
class Stack:
    """Verifier, optional drafter and coordinator, each its own process on loopback."""

    target: str | None = None
    drafter: str | None = "ngram"  # None: no drafter, the coordinator runs verify-only rounds
    dtype: str = "auto"
    gemv_rows: int | None = None  # None: the verifier's default
    float32_weights: bool = False  # the verifier's --float32-weights
    host: str = "127.0.0.1"
    ports: dict[str, int] = field(default_factory=dict)
    verifier_args: list[str] = field(default_factory=list)
    drafter_args: list[str] = field(default_factory=list)
    coordinator_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    startup_timeout_s: float = 600.0
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    _flags: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def start(self) -> Stack:
        """Spawn the services and wait until each is healthy."""
        self.spawn()
        return self.wait_healthy()

    def spawn(self) -> Stack:
        """Start the services' processes, not waiting for them (`wait_healthy`): stacks
        spawned one after another warm up side by side."""
        unset = self.unset_ports()
        if unset:
            chosen = free_ports(len(unset), self.host)
            self.ports = {**self.ports, **dict(zip(unset, chosen, strict=True))}
        try:
            self._spawn("verifier", self.verifier_flags())
            if self.drafter:
                model_drafter = self.drafter != "ngram" and self.target
                target = ["--target", self.target] if model_drafter else []
                self._spawn("drafter", ["--kind", self.drafter, *target, *self.drafter_args])
            drafter_address = self.services["drafter"].address if self.drafter else "none"
            self._spawn(
                "coordinator",
                [
                    "--verifier",
                    self.services["verifier"].address,
                    "--drafter",
                    drafter_address,
                    *self.coordinator_args,
                ],
            )
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> Stack:
        """Wait until every spawned service is healthy; stops them all if one is not."""
        try:
            for service in self.services.values():
                service.wait_healthy(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def unset_ports(self) -> list[str]:
        """The services to start whose port is not chosen yet."""
        names = ["verifier", *(["drafter"] if self.drafter else []), "coordinator"]
        return [name for name in names if not self.ports.get(name)]

    def verifier_flags(self) -> list[str]:
        """The flags the verifier starts with."""
        flags = ["--model", self.target] if self.target else []
        if self.gemv_rows is not None:
            flags += ["--gemv-rows", str(self.gemv_rows)]
        if self.float32_weights:
            flags.append("--float32-weights")
        return [*flags, "--dtype", self.dtype, *self.verifier_args]

    def _spawn(self, name: str, args: list[str]) -> None:
        self._flags[name] = args
        self.services[name] = spawn(name, args, self.host, self.ports.get(name), self.log_dir)

    def restart(self, name: str) -> ServiceProcess:
        """Kill service `name` (SIGKILL) and start it again on its address with the same flags;
        returns the new process, not yet healthy."""
        self.services[name].kill()
        self._spawn(name, self._flags[name])
        return self.services[name]

    def cpu_seconds(self) -> dict[str, float]:
        """Each running service's CPU time so far (none where the OS does not tell it)."""
        used = {name: service.cpu_seconds() for name, service in self.services.items()}
        return {name: seconds for name, seconds in used.items() if seconds is not None}

    @property
    def coordinator(self) -> str:
        return self.services["coordinator"].address

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            service.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
