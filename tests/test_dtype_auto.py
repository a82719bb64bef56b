"""dtype auto on a GPU: the fastest of the exact candidates, timed; half precision never."""

import json
import logging

import mlx.core as mx
import pytest

from specd.models import load as load_module
from specd.models.load import fastest_exact_dtype, resolve_dtype


@pytest.fixture(scope="module")
def half_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model stored in float16, as most published checkpoints are (bfloat16 alike)."""
    path = tmp_path_factory.mktemp("half") / "model"
    path.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    weights = mx.load(str(tiny_model_dir / "model.safetensors"))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()}
    )
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    return path


def test_auto_is_float32_on_a_cpu():
    assert resolve_dtype("auto") == "float32"
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")


def test_both_candidates_are_timed_and_the_faster_kept(tiny_model_dir):
    chosen, timings = fastest_exact_dtype(tiny_model_dir)
    assert set(timings) == {"native", "float32"}
    assert all(ms > 0 for ms in timings.values())
    assert chosen == min(timings, key=timings.get)


def test_a_half_stored_model_is_computed_in_float32(half_model_dir):
    assert fastest_exact_dtype(half_model_dir) == ("float32", {})


def test_a_half_model_too_large_for_float32_stays_as_stored_and_says_so(
    half_model_dir, monkeypatch, caplog
):
    monkeypatch.setattr(load_module, "_fits_float32", lambda model: False)
    with caplog.at_level(logging.WARNING, logger="specd.load"):
        assert fastest_exact_dtype(half_model_dir) == ("native", {})
    assert "too large for float32" in caplog.text


def test_load_target_keeps_the_timed_winner(tiny_model_dir, monkeypatch):
    from specd.models.load import load_target

    monkeypatch.setattr(load_module, "resolve_dtype", lambda requested: "auto")  # as on a GPU
    loaded = load_target(str(tiny_model_dir), "auto")
    assert set(loaded.dtype_timings) == {"native", "float32"}
    assert loaded.dtype == min(loaded.dtype_timings, key=loaded.dtype_timings.get)
    fresh = load_target(str(tiny_model_dir), loaded.dtype)
    prompt = mx.array([[3, 40, 41, 42]])
    assert mx.array_equal(loaded.model(prompt), fresh.model(prompt))
    assert loaded.identity == fresh.identity
