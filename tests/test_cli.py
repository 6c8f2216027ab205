"""offloadctl: the demo runs end to end and reports what it decided."""

from __future__ import annotations

import pytest

from coordinator.cli import main


def test_demo_reports_decision_bytes_and_timings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--layers", "3", "--hidden", "512", "--batch", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "pin decision: pin=False (source: probe.cuda)" in out or "pin=True" in out
    assert "3 layers, 3.0 MiB offloaded" in out  # 3 x (512*512+512) fp32 = 3.0 MiB
    for mode in ("resident", "prefetch", "synchronous"):
        assert f"{mode}:" in out
    assert "outputs identical" in out


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--layers", "0"])
    assert info.value.code == 2
    assert "must be >= 1, got 0" in capsys.readouterr().err
