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
