"""Shared test set-up: `gpu`-marked tests skip cleanly on machines without CUDA; CI's property
tests draw the same examples every run (HYPOTHESIS_PROFILE=ci, set by .ci/run), so a build
fails for a change, not for a draw; run without it, they explore new examples each time."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import warnings

import pytest
import torch
from hypothesis import settings

from coordinator.tools import reference

# Ray starts its workers at nice 15: beside anything else at nice 0 on a 2-core machine (another
# suite, a pip install, `make test-busy`'s hogs) they got ~3% of a core, and every Ray test
# crawled towards its timeouts. Every Ray the tests start (in-process, Cluster nodes, private
# heads, offloadctl subprocesses: they inherit this environment) runs its workers at nice 0,
# as the tests themselves run.
os.environ.setdefault("RAY_worker_niceness", "0")
# Bytecode is written, whatever the environment says: with PYTHONDONTWRITEBYTECODE=1 (set on
# this machine and on CI's) no process kept the .pyc of our editable package or the rewritten
# asserts of the test modules, so each of the suite's ~180 Python processes (Ray workers,
# keepers, probes, offloadctl, pytest) compiled again what it imported: measured, 0.3 against
# 0.7 CPU-s to import all 86 of our modules (0.05 against 0.13 for a stage worker's), and 15
# against 18 CPU-s for a whole collection. This process and every one the tests start (they
# inherit this environment) write and reuse them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# No idle workers started ahead of any task: a raylet started two as its first driver
# connected, each importing Ray (~2 CPU-s), and in the sampled suite 7 of them ended without
# ever running anything. A worker starts when a task or actor asks for one, as it would anyway.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# No Ray metrics where no test reads them: every worker and actor sends its metrics to its
# node's agent every 10 s, and each node's agent sweeps every process of the node for the
# dashboard every 5 s; nothing of the tests reads either but the two clusters that scrape our
# gauges (`ray_head.metrics_head` turns collection back on for its own). An idle 4-node
# cluster with 3 actors: 6.9 against 4.9 CPU-s a minute, sampled.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# The nodes' compute timings (worker/compute_probe.py) are cached on disk per model shape: the
# tests keep theirs in a directory of their own, never the user's ~/.cache, removed at exit.
if "OFFLOAD_COMPUTE_CACHE" not in os.environ:
    os.environ["OFFLOAD_COMPUTE_CACHE"] = tempfile.mkdtemp(prefix="offload-compute-")
    atexit.register(shutil.rmtree, os.environ["OFFLOAD_COMPUTE_CACHE"], ignore_errors=True)

# One intra-op thread in the pytest processes: `make test` runs two of them beside Ray's workers,
# so a second thread has no core of its own, and OpenMP's threads spin between ops. Three test
# modules (generation, prefetch, families) in one process on a quiet 2-core machine: 121-127
# CPU-s with one thread against 135-152 with torch's default two. Comparisons whose two sides
# may differ in threads (a worker and the reference) set theirs explicitly, as before.
torch.set_num_threads(1)

# The parity tests load the same few small checkpoints with `from_pretrained` hundreds of times
# (~0.1 s each): the reference keeps the last few it loaded, loading again a checkpoint whose
# files changed (coordinator.tools.reference.keep).
reference.keep(4)

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# The modules that start Ray clusters and workers, the longest first: `make test` hands whole
# modules to its two pytest processes in collection order, and a long one handed out last ran
# alone at the end while the other process idled. One process (TEST_WORKERS=0): order only.
LONGEST_FIRST = (
    "test_pipeline.py",
    "test_recovery.py",
    "test_shared_cluster.py",
    "test_named_loads.py",
    "test_serving.py",
    "test_gpu_check.py",
    "test_signals.py",
    "test_fuzz_serving.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _connected() -> bool:
    ray = sys.modules.get("ray")  # not imported: nothing to release, and no import for it
    return ray is not None and ray.is_initialized()


def _ray_holdings() -> tuple[set[str], set[str]]:
    """(named loads, placement groups not removed) of the Ray this process is connected to."""
    from ray.util import placement_group_table

    from coordinator.runtime import registry

    groups = {pg_id for pg_id, g in placement_group_table().items() if g["state"] != "REMOVED"}
    return set(registry.list_loads()), groups


@pytest.fixture(autouse=True)
def release_what_the_test_left():
    """After each test, the named loads and placement groups it made and did not release (it
    failed midway, say) are released, with a warning: one failure never leaves GPUs held for
    later tests, which would then wait out their placement timeouts. What existed before the
    test (a module's or a class's job: wider fixtures are set up before this one) stays."""
    loads_before, groups_before = _ray_holdings() if _connected() else (set(), set())
    yield
    if not _connected():
        return
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from coordinator.runtime import registry

    loads = sorted(_ray_holdings()[0] - loads_before)
    for name in loads:
        registry.forget(name)  # its workers, keeper, record and placement groups
    groups = sorted(_ray_holdings()[1] - groups_before)
    for pg_id in groups:  # also kills the actors in it (an unnamed job left open)
        with contextlib.suppress(Exception):  # removed meanwhile: nothing held
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
    if loads or groups:
        warnings.warn(
            f"left behind, now released: named loads {loads}, placement groups {groups}",
            stacklevel=1,
        )


@pytest.fixture(autouse=True, scope="session")
def nodes_measured_what_the_tests_launch():
    """The tests' simulated nodes find each model they launch measured (`worker.compute_probe`),
    as a machine finds the models it ran before: the launches in this process measure the
    model's decoder layer here (this process imported torch and the model's code at collection)
    before their nodes' probes run, so the probes read it from the node's cache. Measured by the
    probe task itself, each first launch of a model shape cost a Ray worker torch's and the
    model's imports (~4.7 CPU-s, six times in a sampled suite). The measuring itself in a probe
    process stays tested: `test_probe` (a probe with an empty cache, in a process of its own)
    and `test_compute_probe` (the timing, the cache and its lock). Only where Ray's launch code
    was collected (a Ray test module): no import of Ray for it."""
    if "coordinator.runtime.launch" not in sys.modules or torch.cuda.is_available():
        yield  # with CUDA the probes measure the GPU, which this process does not use
        return
    # `launch` only: a re-plan in this process (coordinator.runtime.recovery) is of a model
    # that its launch here measured already.
    from coordinator.runtime import launch
    from worker.compute_probe import measure

    real = launch.model_of

    def model_of(index, config):
        model = real(index, config)
        config_json, dtype, threads = model
        with contextlib.suppress(Exception):  # a model the probe cannot build: it says so
            measure(config_json, dtype, "cpu", threads=threads)
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "model_of", model_of)
        yield


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The real (tiny, trained) tokenizer make-checkpoint writes, with its chat template: a
    module's own unless it defines `tokenizer` itself."""
    from coordinator.serving.text import load_tokenizer
    from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

    root = tmp_path_factory.mktemp("text") / "ckpt"
    shape = CheckpointShape(
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        vocab_size=512,
    )
    return load_tokenizer(make_checkpoint(root, shape))
