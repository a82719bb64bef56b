import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_tiny_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory) -> Path:
    """Different weights and one more token: a target nothing here was made for."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny2") / "model", seed=1, extra_specials=("<|extra|>",)
    )
