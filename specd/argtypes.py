"""argparse value types shared by the `specd` subcommands and `specd bench`."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    return _at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _at_least(text, 0)


def _at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # what the protobuf int32 fields hold


def int_between(least: int, most: int = INT32_MAX):
    """An integer flag in [least, most] (int32 by default: what the protobuf fields hold)."""

    def parse(text: str) -> int:
        value = _at_least(text, least)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        return value

    parse.__name__ = f"integer in [{least}, {most}]"
    return parse


def port(text: str) -> int:
    return int_between(0, 65535)(text)


def positive_float(text: str) -> float:
    value = _finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def probability_below_one(text: str) -> float:
    """A probability a draft may need: 0 <= p < 1 (1 would refuse every draft after the first)."""
    value = _finite(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 0 and < 1, got {text}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def byte_size_or_zero(text: str) -> int:
    """A memory size as `byte_size` reads it, or 0 (or "off") for none."""
    return 0 if text.strip().lower() in ("0", "off") else byte_size(text)


def byte_size(text: str) -> int:
    """A memory size: bytes, or a number with a unit such as 512MiB, 8GiB, 2GB."""
    number = text.strip().lower().rstrip("bikmgt")
    unit = text.strip().lower()[len(number) :]
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 8GiB, 512MiB or a byte count, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return int(value)
