"""Imports flow coordinator -> worker -> offload, checked in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


def _top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("offload", {"ray", "worker", "coordinator"}),
        # Every backend too: the package imports them lazily, so import them explicitly.
        (
            "offload.prefetch, offload.uva, offload.factory, offload.link",
            {"ray", "worker", "coordinator"},
        ),
        ("worker", {"coordinator"}),
        # The planning side of the driver, which `offloadctl plan` runs without Ray.
        ("coordinator.cli, coordinator.planning", {"ray"}),
        # every module of planning/ explicitly (the package imports none of them)
        ("coordinator.planning.checkpoint, coordinator.planning.weight_map, "
         "coordinator.planning.snapshot, coordinator.planning.budgets, "
         "coordinator.planning.planner, coordinator.planning.search", {"ray"}),
    ],
)
def test_import_does_not_pull_in_upper_layers(module: str, forbidden: set[str]) -> None:
    loaded = _top_level(_modules_after_import(module))
    assert module.split(".")[0] in loaded  # the import really happened
    assert not (loaded & forbidden), f"importing {module} loaded {sorted(loaded & forbidden)}"


def test_public_api_of_offload() -> None:
    import offload

    for name in (
        "decide_pinning", "probe_node", "create_offloader", "OffloadConfig", "PrefetchOffloader",
        "UVAOffloader", "NoopOffloader", "HostArena", "PinDecision", "NodeProbe",
    ):  # fmt: skip
        assert getattr(offload, name) is not None, name


def test_coordinator_api_is_importable_from_the_package() -> None:
    import coordinator
    from coordinator.runtime.job import launch

    assert coordinator.launch is launch
    assert coordinator.JobConfig.__module__ == "coordinator.config"
