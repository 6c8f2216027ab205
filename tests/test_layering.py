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
        # The planning side of the driver, which `offloadctl plan` runs without Ray, and the
        # pre-launch check of untested families that it runs too.
        ("coordinator.cli, coordinator.planning, coordinator.family_check", {"ray"}),
        # The engine's loop and scheduler run in-process pipelines without Ray (the Ray
        # pipeline is a module of its own), and batch sizing is planning.
        ("coordinator.engine, coordinator.planning.batch_size", {"ray"}),
        # every module of planning/ explicitly (the package imports none of them)
        (
            "coordinator.planning.checkpoint, coordinator.planning.weight_map, "
            "coordinator.planning.snapshot, coordinator.planning.budgets, "
            "coordinator.planning.planner, coordinator.planning.search",
            {"ray"},
        ),
        # A named load's record runs in a process of its own for as long as the load: Ray and
        # this module only (torch and transformers cost ~0.2 GiB and ~2 s of CPU per load),
        # but for the stdlib-only start of our Ray processes (worker.startup, allowed below).
        ("coordinator.runtime.record", {"torch", "transformers", "offload", "worker"}),
        # A named load's keeper, its engine (the steps' values, `worker.steps`) and the server
        # in every Serve replica: they run for as long as the load, without torch (a keeper:
        # 144 against 346 MiB, ~1 against 2.5-4 CPU-s).
        (
            "coordinator.runtime.keeper, coordinator.serving.app, coordinator.engine.host",
            {"torch", "transformers"},
        ),
        # The probe task's module: on a node without GPUs a probe starts without torch (it
        # imports torch only to measure what its node has not measured before).
        ("worker.node", {"torch", "transformers", "ray", "coordinator"}),
    ],
)
def test_import_does_not_pull_in_upper_layers(module: str, forbidden: set[str]) -> None:
    modules = _modules_after_import(module)
    assert module.split(".")[0] in modules  # the import really happened
    if module.startswith("coordinator"):  # its __init__ runs worker.startup (stdlib only)
        modules -= {"worker", "worker.startup"}
    loaded = _top_level(modules)
    assert not (loaded & forbidden), f"importing {module} loaded {sorted(loaded & forbidden)}"


def test_public_api_of_offload() -> None:
    import offload

    for name in (
        "decide_pinning",
        "probe_node",
        "create_offloader",
        "OffloadConfig",
        "PrefetchOffloader",
        "UVAOffloader",
        "NoopOffloader",
        "HostArena",
        "PinDecision",
        "NodeProbe",
    ):
        assert getattr(offload, name) is not None, name


def test_coordinator_api_is_importable_from_the_package() -> None:
    import coordinator
    from coordinator.runtime.launch import launch

    assert coordinator.launch is launch
    assert coordinator.JobConfig.__module__ == "coordinator.config"


@pytest.mark.parametrize("package", ["offload", "worker", "coordinator"])
def test_no_package_has_an_import_cycle(package: str) -> None:
    """No module of a package imports (at top level or inside a function) one that imports it
    back, directly or through others: each module can be read, and changed, on its own. What
    a module imports only for its type hints (`if TYPE_CHECKING:`) runs nothing and is left
    out. Issue 58 point 4: offload had copy_engine <-> staging, worker batch_cache <->
    batch_view and layout <-> stage."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    modules = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (root / package).rglob("*.py")
    }

    def imports(tree: ast.AST):
        for node in ast.iter_child_nodes(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                yield from (n for child in node.orelse for n in imports_of(child))
                continue
            yield from imports_of(node)

    def imports_of(node: ast.AST):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            yield from imports(node)

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps - {package}  # the package's lazy re-exports are not imports

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph[start]:
            if dep == goal or (dep not in seen and (seen.add(dep) or reaches(dep, goal, seen))):
                return True
        return False

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, f"modules in import cycles: {cycles}"
