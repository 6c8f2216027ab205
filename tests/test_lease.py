"""A leased named load (`launch(..., lease_s=...)`, as `serve` launches its own): it stays while
its holder renews the lease, and once the renewals stop (the holder killed with -9) its keeper
unloads it: record, workers, placement group, GPU, keeper."""

from __future__ import annotations

import time

import pytest
import ray
from helpers import wait_gpus_free

from coordinator.config import ConfigError, JobConfig
from coordinator.planning.checkpoint import load_index
from coordinator.runtime import keeper, registry
from coordinator.runtime.launch import launch
from coordinator.runtime.lease import LeaseHolder
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

LEASE_S = 5.0
GONE_BOUND_S = 60.0  # past the lease: the keeper's poll, its unload, ray.kill's delivery


@pytest.fixture(scope="module")
def ray_one_gpu():
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_a_load_whose_lease_is_not_renewed_is_unloaded(ray_one_gpu, tmp_path) -> None:
    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        CheckpointShape(
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=128,
        ),
    )
    config = JobConfig(
        checkpoint=str(checkpoint),
        gpu_memory_bytes=load_index(checkpoint).total_bytes,
        max_seq_len=16,
    )
    with pytest.raises(ConfigError, match=r"lease_s=5\.0: a lease is a positive time, for a named"):
        launch(config, lease_s=LEASE_S)  # an unnamed job ends with its process anyway
    name = "leased"
    holder = LeaseHolder(name, LEASE_S)  # renewing before the launch, as serve does
    try:
        launch(config, name=name, lease_s=LEASE_S).close()  # detached: only the lease holds it
        assert ray.available_resources().get("GPU", 0) == 0
        held_until = time.monotonic() + 3 * LEASE_S  # renewed: it stays past several leases
        while time.monotonic() < held_until:
            assert registry.list_loads() == [name]
            time.sleep(0.5)
        assert holder.renew(timeout_s=10) == 1
        the_keeper = keeper.find(name)
        assert the_keeper is not None
    finally:
        holder.close()  # the holder is gone: no renewal from now on
    stopped = time.monotonic()
    while registry.list_loads():
        assert time.monotonic() - stopped < LEASE_S + GONE_BOUND_S, "the lease did not end it"
        time.sleep(0.2)
    assert time.monotonic() - stopped > LEASE_S / 2  # not before its lease ran out
    assert registry.named_groups(name) == {}  # its placement group went with it
    wait_gpus_free(1)
    deadline = time.monotonic() + GONE_BOUND_S  # and the keeper ended itself, for good
    while keeper.find(name) is not None:
        assert time.monotonic() < deadline, "the keeper outlived its load"
        time.sleep(0.2)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(the_keeper.ping.remote(), timeout=GONE_BOUND_S)
