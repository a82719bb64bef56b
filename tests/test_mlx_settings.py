"""specd's process-wide MLX settings: a kernel cache that survives restarts, float32 kept whole;
a user's own choice of either is kept."""

from specd import mlx_settings


def test_apply_sets_both_when_unset(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    mlx_settings.apply()
    import os

    folder = os.environ["MLX_PTX_CACHE_DIR"]
    assert folder.startswith(str(tmp_path / "specd" / "mlx-kernels"))
    assert os.path.isdir(folder)
    assert os.environ["MLX_ENABLE_TF32"] == "0"


def test_a_users_choice_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    mlx_settings.apply()
    import os

    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["MLX_ENABLE_TF32"] == "1"


def test_an_unwritable_cache_leaves_mlx_its_default(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert mlx_settings.use_persistent_kernel_cache() is None
    import os

    assert "MLX_PTX_CACHE_DIR" not in os.environ
