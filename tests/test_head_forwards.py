"""Where the EAGLE-3 head's forwards of a few rows run (--head-forwards): the drafter takes the
choice, auto picks the host where specd's kernels are built, and host is refused, with the
reason, where they cannot run the head."""

from __future__ import annotations

import pytest

from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.eagle3.cpu_head import CpuHead
from drafter_svc.server import make_proposer
from specd.cpu.row_products import layer_kernels


def _proposer(forwards: str | None):
    return make_proposer(DrafterConfig(**drafter_options("eagle3", head_forwards=forwards)))


@pytest.mark.parametrize(("forwards", "runs_on"), [("mlx", "mlx"), ("host", "numpy"),
                                                   (None, "numpy")])  # fmt: skip
def test_the_head_runs_where_asked(forwards, runs_on):
    if runs_on == "numpy" and layer_kernels() is None:
        pytest.fail("specd's compiled kernels are not built: `make setup` builds them")
    assert _proposer(forwards).params()["chain_forwards"] == runs_on


def test_host_forwards_are_refused_where_the_kernels_cannot_run_the_head(monkeypatch):
    monkeypatch.setattr(CpuHead, "attach", classmethod(lambda cls, head, embedding: None))
    with pytest.raises(ValueError, match="--head-forwards host: this head cannot run on the host"):
        _proposer("host")
    assert _proposer(None).params()["chain_forwards"] == "mlx"  # auto falls back


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="--head-forwards must be one of auto, host, mlx"):
        drafter_options("eagle3", head_forwards="gpu")
