"""How plans and telemetry write sizes, rates, times and layer lists: '3.88 MiB', '25.0 GB/s',
'0.020 ms', 'embed,layers.0-5'."""

from __future__ import annotations

from collections.abc import Sequence


def format_bytes(num: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num) >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num} B"


def format_rate(bytes_per_s: float) -> str:
    """Decimal units, as link rates are quoted: '25.0 GB/s'."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s:.1f} B/s"


def format_seconds(t_s: float) -> str:
    return f"{t_s:.3f} s" if t_s >= 1 else f"{t_s * 1e3:.3f} ms"


def layer_range(names: Sequence[str]) -> str:
    """'embed,layers.0-5' for embed, layers.0 .. layers.5; runs of decoders are collapsed."""
    parts: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            parts.append(f"layers.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
            run.clear()

    for name in names:
        prefix, _, index = name.rpartition(".")
        if prefix == "layers" and index.isdigit() and (not run or int(index) == run[-1] + 1):
            run.append(int(index))
            continue
        flush()
        if prefix == "layers" and index.isdigit():
            run.append(int(index))
        else:
            parts.append(name)
    flush()
    return ",".join(parts)
