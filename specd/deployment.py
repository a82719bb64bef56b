"""The deployment file: one TOML describing which service runs where with which options.

[verifier]            # keys are the flags of `specd serve verifier`, dashes or underscores
host = "0.0.0.0"
port = 50051
[drafter]
host = "10.0.0.2"
kind = "ngram"
[coordinator]
verifier = "10.0.0.1:50051"
drafter = "10.0.0.2:50052"
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SERVICES = ("verifier", "drafter", "coordinator")


class DeploymentError(ValueError):
    pass


def load(path: Path) -> dict[str, dict]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DeploymentError(f"cannot read deployment file {path}: {exc}") from None
    unknown = set(data) - set(SERVICES)
    if unknown:
        raise DeploymentError(f"{path}: unknown table(s) {sorted(unknown)}; use {SERVICES}")
    return data


def service_table(path: Path, service: str, known: set[str]) -> dict:
    """The [service] table as argparse defaults; unknown keys are errors, not ignored."""
    table = {key.replace("-", "_"): value for key, value in load(path).get(service, {}).items()}
    unknown = sorted(set(table) - known - {"help"})
    if unknown:
        raise DeploymentError(f"{path} [{service}]: unknown option(s) {unknown}")
    return table  # argparse converts string values (paths) with each flag's type


def address(path: Path, service: str, default_port: int) -> str:
    """Where to reach a service of this file from this machine."""
    table = load(path).get(service, {})
    host = table.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"{host}:{table.get('port', default_port)}"
