"""Run as a Ray task by test_pipeline, pickled by value: a fresh Ray worker process's GC
thresholds once it imported one of our packages, and after `settle()` (worker.startup). A
module of its own, so the task's process imports nothing of ours before the package tested."""

from __future__ import annotations


def thresholds_around(package: str) -> tuple[tuple, tuple]:
    import gc
    import importlib

    importlib.import_module(package)
    imported = gc.get_threshold()
    from worker.startup import settle

    settle()
    return imported, gc.get_threshold()
