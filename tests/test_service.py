import grpc
import pytest

from specd.service import FailedPrecondition, ResourceExhausted, SessionTable


def test_session_table_limits_and_unknown_ids():
    table = SessionTable(limit=2, idle_timeout_s=60)
    a = table.add("A")
    table.add("B")
    with pytest.raises(ResourceExhausted) as full:
        table.add("C")
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 2" in str(full.value)
    assert table.pop(a) == "A"
    with pytest.raises(FailedPrecondition):
        table.get(a)
    table.add("C")
    assert len(table) == 2


def test_idle_sessions_expire_and_used_ones_stay(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("specd.service.time.monotonic", lambda: now[0])
    table = SessionTable(limit=10, idle_timeout_s=30)
    idle, used = table.add("idle"), table.add("used")
    now[0] += 20
    table.get(used)
    now[0] += 20
    assert table.expire() == 1
    assert table.get(used) == "used"
    with pytest.raises(FailedPrecondition) as gone:
        table.get(idle)
    assert "expired" in str(gone.value)


def test_a_port_in_use_is_refused_not_shared():
    """gRPC's default SO_REUSEPORT let a second service share a busy port, and calls went to
    whichever answered (a Stack once gave its verifier and drafter the same port)."""
    import asyncio
    import subprocess
    import sys

    from specd.launch import free_ports
    from specd.service import CannotBind, Server

    async def hold_and_try_again():
        held = Server("127.0.0.1", 0, [])
        with pytest.raises(CannotBind, match="in use"):
            Server("127.0.0.1", held.port, [])
        run = subprocess.run(
            [sys.executable, "-m", "specd", "serve", "drafter", "--port", str(held.port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 1
        assert f"specd: drafter: cannot listen on 127.0.0.1:{held.port}" in run.stderr

    asyncio.run(hold_and_try_again())
    ports = free_ports(8)
    assert len(set(ports)) == 8
