"""The coordinator's tokenizer comes from the verifier, so it needs no copy of the model."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from specd.models.resolve import default_cache_dir


def load_served_tokenizer(files: dict[str, bytes], model_identity, cache_dir: Path | None):
    from mlx_lm.utils import load_tokenizer

    if "tokenizer.json" not in files and "tokenizer.model" not in files:
        raise RuntimeError("the verifier sent no tokenizer.json or tokenizer.model")
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    root = Path(cache_dir or default_cache_dir()) / "tokenizers"
    folder = root / digest.hexdigest()[:24]
    if not folder.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root))
        for name, data in files.items():
            (staging / Path(name).name).write_bytes(data)  # base names only: no path tricks
        try:
            os.replace(staging, folder)
        except OSError:  # another coordinator got there first
            shutil.rmtree(staging, ignore_errors=True)
    return load_tokenizer(folder, eos_token_ids=list(model_identity.eos_token_ids))
