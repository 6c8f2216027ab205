"""Sizes as people write them: '512MiB', '1.5GB', '1000' (bytes). One parser for the command
line, job files and the node variables the offload library reads (`offload.simulated`)."""

from __future__ import annotations

import re

from offload.errors import ConfigError

UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(value: str | int, *, field_name: str = "size") -> int:
    """'512MiB', '1.5GB', '1000' or an int -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{field_name}={value} must be >= 0")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in UNITS:
        raise ConfigError(
            f"{field_name}={value!r} is not a size; write e.g. 512MiB, 1.5GB or a byte count"
        )
    number = float(match.group(1))
    if UNITS[unit] == 1 and not number.is_integer():  # `--gpu-memory 1.5` is not 1 byte
        raise ConfigError(
            f"{field_name}={value!r}: a byte count is a whole number; for larger "
            "units write them, e.g. 1.5GiB"
        )
    return int(number * UNITS[unit])
