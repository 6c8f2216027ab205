"""The driver: `planning/` (checkpoint index, planner; no Ray), `runtime/` (worker group,
pipeline, recovery, telemetry, named loads) and the `offloadctl` CLI.

from coordinator import JobConfig, launch

with launch(JobConfig(checkpoint="ckpt/", gpus=3, gpu_memory_bytes=6 << 20)) as job:
    logits = job.forward(input_ids)
"""

from worker.startup import quiet_imports

quiet_imports()  # first thing in a keeper, probe or replica process: see worker.startup

# Loaded on first use (PEP 562), so `offloadctl plan` and `import coordinator.config` do not
# pay for importing Ray.
_LAZY = {
    "launch": "coordinator.runtime.launch",
    "Job": "coordinator.runtime.job",
    "JobConfig": "coordinator.config",
    "Override": "coordinator.config",
    "NodeMatch": "coordinator.config",
    "plan": "coordinator.planning.planner",
    "Plan": "coordinator.planning.planner",
    "PlanOptions": "coordinator.planning.planner",
    "load_index": "coordinator.planning.checkpoint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
