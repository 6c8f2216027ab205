"""Named loads on a cluster: load --name leaves detached workers behind; run, status, list and
unload attach to them by name from later commands; unload releases every GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
from helpers import (
    assert_probe_decided_pin,
    scrape_gauges,
    stage_table_rows,
    tiny_shape,
    wait_gpus_free,
)
from ray_head import free_ports, metrics_head

from coordinator.cli import EXIT_ERROR, main
from coordinator.planning.checkpoint import load_index
from coordinator.runtime import registry
from coordinator.tools.make_checkpoint import make_checkpoint

METRICS_PORT = free_ports(1)[0]


LIST_CODE = (
    "import sys\n"
    "from coordinator.cli import main\n"
    "assert main(['list', '--address', sys.argv[1]]) == 0\n"
    "print(*(f'{m}={m in sys.modules}' for m in ('torch', 'transformers')))\n"
)


@pytest.fixture(scope="module")
def cluster():
    with metrics_head(num_gpus=3, metrics_port=METRICS_PORT) as c:
        yield c


def test_load_run_status_list_unload(cluster, tmp_path, capsys) -> None:
    """A bf16 qwen2 whose embedding is tied to its head (one tensor, read by the first stage
    and the last), over three GPUs that prefetch offloaded layers: `load` reports each stage's
    pin decision, draws and writes the memory, and `run --check` (a warm-up, then the pass it
    checks: twice through the prefetch schedule) is bitwise equal to transformers."""
    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        tiny_shape(6, arch="qwen2", tie_embeddings=True, dtype="bfloat16"),
    )
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    budget = str(index.total_bytes // 3 - decoder // 4 + 16 * 1024)  # + a 12 KiB KV cache
    address = ["--address", cluster.address]
    assert (
        main(
            [
                "load",
                "--checkpoint",
                str(checkpoint),
                "--gpu-memory",
                budget,
                "--name",
                "m1",
                "--snapshot-interval",
                "0.5",
                "--max-seq-len",
                "24",
                "--plot",
                str(tmp_path / "memory.png"),
                "--memory-json",
                str(tmp_path / "memory.json"),
                *address,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "stays on the cluster" in out
    rows = stage_table_rows(out)  # the per-stage table with each decision
    assert len(rows) == 3
    for device, pin in rows:
        assert_probe_decided_pin(device, pin)
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert len(memory["gpus"]) == 3 and memory["nodes"][0]["workers_rss_bytes"] > 0
    assert ray.available_resources().get("GPU", 0) == 0  # the workers are still there
    assert list(registry.named_groups("m1")) == ["load:m1:pg-0"]  # their GPUs, reserved as one

    assert (
        main(
            [
                "load",
                "--checkpoint",
                str(checkpoint),
                "--gpu-memory",
                budget,
                "--name",
                "m1",
                *address,
            ]
        )
        == EXIT_ERROR
    )
    assert "already exists" in capsys.readouterr().err

    # `list` in a process of its own, as a user runs it: it imports neither torch nor the
    # workers' code (what made it cost 5 s of CPU), only Ray and the records.
    listed = subprocess.run(
        [sys.executable, "-c", LIST_CODE, cluster.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert listed.stdout.split() == ["m1", "torch=False", "transformers=False"]

    assert main(["run", "m1", "--check", *address]) == 0
    out = capsys.readouterr().out
    assert "attached to load 'm1'" in out
    assert "check: logits are bitwise equal to transformers in one process" in out
    assert ray.available_resources().get("GPU", 0) == 0  # run detached, did not release

    # Text from the named load, from another command: its tokenizer, its planned KV cache.
    assert main(["generate", "m1", "--prompt", "the cat", "--max-new-tokens", "5", *address]) == 0
    generated = capsys.readouterr()
    assert "tokens/s" in generated.err
    assert (
        main(["generate", "m1", "--prompt", "the cat", "--max-new-tokens", "40", *address])
        == EXIT_ERROR
    )
    assert "exceed the KV cache reserved for max_seq_len=24" in capsys.readouterr().err

    assert main(["status", "m1", "--json", *address]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [g["stage"] for g in status["gpus"]] == [0, 1, 2]
    # the generating process's engine left its stats with the load's keeper
    serving = status["serving"]
    assert serving["generation_tokens"] == 5 and serving["requests"] == 1  # 40 never fitted
    assert serving["requests_running"] == 0 and serving["ttft_p50_s"] > 0
    assert sum(g["offloaded_bytes"] for g in status["gpus"]) > 0
    # No driver is left, yet Prometheus sees the load: its record publishes the workers'
    # periodic snapshots, and `run` above made copies that the gauges now count.
    offloaded = {str(g["stage"]): float(g["offloaded_bytes"]) for g in status["gpus"]}
    assert scrape_gauges("offload_offloaded_weight_bytes", offloaded, METRICS_PORT) == offloaded
    copies = {str(g["stage"]): float(g["copies"]) for g in status["gpus"]}
    assert sum(copies.values()) > 0
    assert {g["backend"] for g in status["gpus"] if g["offloaded_bytes"]} == {"prefetch"}
    assert scrape_gauges("offload_copies", copies, METRICS_PORT) == copies
    up = {str(g["stage"]): 1.0 for g in status["gpus"]}
    assert scrape_gauges("offload_stage_up", up, METRICS_PORT) == up
    plot = tmp_path / "m1.png"
    assert main(["status", "m1", "--plot", str(plot), *address]) == 0
    table = capsys.readouterr().out
    assert "device used/total" in table and "host available" in table  # per GPU, per node
    assert plot.read_bytes()[:4] == b"\x89PNG"

    assert main(["unload", "m1", *address]) == 0
    assert "3 workers released" in capsys.readouterr().out
    wait_gpus_free(3)
    assert registry.named_groups("m1") == {}  # the placement group went with them
    assert main(["list", *address]) == 0
    assert "no named loads" in capsys.readouterr().out
    assert main(["run", "m1", *address]) == EXIT_ERROR
    assert "no load named 'm1'" in capsys.readouterr().err


def test_every_client_of_a_load_goes_through_its_one_engine(cluster, tmp_path) -> None:
    """Two processes and two handles in this one generate on one named load at once (4 KV
    slots, 6 requests: some wait for a slot freed by another client's request): each text
    equals transformers on its prompt alone. A second engine cannot claim the workers, and a
    step that is not the load's engine's is refused by the worker with a clear error."""
    import os
    import threading
    import time

    import torch

    from coordinator.config import JobConfig
    from coordinator.runtime.job_engine import build_engine
    from coordinator.runtime.launch import attach, launch
    from coordinator.tools.reference import reference_generate
    from worker.steps import ClaimedByAnotherError, StepRows

    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        tiny_shape(4),
    )
    config = JobConfig(
        checkpoint=str(checkpoint),
        address=cluster.address,
        gpu_memory_bytes=load_index(checkpoint).total_bytes,  # one GPU holds it all...
        nodes=f"{ray.get_runtime_context().get_node_id()}=1",  # ...and it gets one: one worker
        max_batch=4,
        max_seq_len=32,
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (1, 3 + i), generator=g) for i in range(6)]
    new_tokens = 12
    expected = [
        reference_generate(
            str(checkpoint),
            p,
            num_threads=1,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )[0, p.shape[1] :].tolist()
        for p in prompts
    ]

    @ray.remote(num_cpus=0)
    def generate_elsewhere(name: str, prompts: list[list[int]]) -> tuple[int, list[list[int]]]:
        """Another process (a Ray worker's; one, as each costs seconds of imports here): its
        own handle, its prompts generated at once."""
        import os
        from concurrent.futures import ThreadPoolExecutor

        from coordinator.runtime.launch import attach

        with attach(name) as job, ThreadPoolExecutor(len(prompts)) as pool:
            outs = pool.map(
                lambda prompt: job.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                )[0, len(prompt) :].tolist(),
                prompts,
            )
            return os.getpid(), list(outs)

    launch(config, name="shared").close()
    try:
        outs: dict[int, list[int]] = {}
        handles = [attach("shared", address=cluster.address) for _ in range(2)]
        elsewhere = generate_elsewhere.remote("shared", [prompts[i][0].tolist() for i in (4, 5)])

        def here(i: int) -> None:
            job = handles[i % 2]
            out = job.generate(
                prompts[i], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
            )
            outs[i] = out[0, prompts[i].shape[1] :].tolist()

        threads = [threading.Thread(target=here, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        pid, far = ray.get(elsewhere, timeout=180)
        assert pid != os.getpid()  # really another process
        outs.update(zip((4, 5), far, strict=True))
        assert [outs[i] for i in range(6)] == expected
        stats = handles[0].serving_stats()
        assert stats["requests"] == 6 and stats["requests_running"] == 0
        # the engine ran those six in the keeper, a process that never imported torch (nor
        # transformers): its steps go out and its tokens come back as numpy arrays
        heavy = handles[0].keeper.__ray_call__.remote(
            lambda keeper: [m for m in ("torch", "transformers") if m in sys.modules]
        )
        assert ray.get(heavy, timeout=60) == []

        # no second writer: another engine cannot claim the workers...
        job = handles[0]
        with pytest.raises(ClaimedByAnotherError, match="owns its KV pool"):
            build_engine(
                lambda: job.workers,
                lambda: job.config,
                lambda: job.plan,
                recover=job.recover_after,
                gate=job.passes,
                name="intruder",
                index=job.index,
            )
        # ...and a step that is not the load's engine's is refused, never run
        rows = StepRows.in_slots(
            (0,), (0,), (1,), 1, num_slots=4, max_seq_len=32, owner=("intruder", 1)
        )
        with pytest.raises(ray.exceptions.RayTaskError, match="two engines must never write"):
            ray.get(job.workers[0].actor.batch_step.remote(rows, torch.tensor([[3]])), timeout=60)

        def greedy(i: int) -> list[int]:
            out = job.generate(
                prompts[i], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
            )
            return out[0, prompts[i].shape[1] :].tolist()

        assert greedy(0) == expected[0]  # the load's engine goes on, its texts unchanged
        # the keeper's process dies: Ray starts it again, its new engine takes the workers
        # over, and the clients go on through it (the same handle)
        ray.kill(job.keeper, no_restart=False)
        deadline = time.monotonic() + 120
        while True:  # until the new keeper answers, with a new engine (its own count)
            try:
                stats = ray.get(job.keeper.stats.remote(), timeout=10)
                if stats is not None and stats["requests"] == 0:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.monotonic() < deadline, "the keeper did not come back"
            time.sleep(0.5)
        assert greedy(1) == expected[1]
        for handle in handles:
            handle.close()
    finally:
        registry.unload("shared")
    wait_gpus_free(3)


def test_a_named_loads_keeper_rebalances_its_pool_and_the_texts_stay(cluster, tmp_path) -> None:
    """Issue 59 point 2 through a named load: a client asks the load to re-balance for long
    sequences; its keeper (the one process that changes a named load) grows the pool with the
    stage kept, records the event and the new pool in the load's record, and its engine serves
    from the new pool's blocks, every text still transformers' on its prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from coordinator.config import JobConfig
    from coordinator.planning.pool import Lengths
    from coordinator.runtime.launch import attach, launch
    from coordinator.tools.reference import reference_generate

    checkpoint = make_checkpoint(tmp_path / "ckpt", tiny_shape(4))
    index = load_index(checkpoint)
    one = sum(x.kv_bytes(1, 32) for x in index.layers)
    config = JobConfig(
        checkpoint=str(checkpoint),
        address=cluster.address,
        gpu_memory_bytes=index.total_bytes + one + 4096,  # everything and one sequence
        nodes=f"{ray.get_runtime_context().get_node_id()}=1",
        max_batch=3,
        max_seq_len=32,
        kv_cache_tokens=32,
    )
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 128, (1, 4 + i), generator=g) for i in range(3)]
    expected = [
        reference_generate(
            str(checkpoint), p, num_threads=1, max_new_tokens=20, do_sample=False, eos_token_id=None
        )[0, p.shape[1] :].tolist()
        for p in prompts
    ]

    def texts(job) -> list[list[int]]:
        with ThreadPoolExecutor(3) as pool:
            outs = pool.map(
                lambda p: job.generate(p, max_new_tokens=20, do_sample=False, eos_token_id=None),
                prompts,
            )
            return [o[0, p.shape[1] :].tolist() for o, p in zip(outs, prompts, strict=True)]

    launch(config, name="balanced").close()
    try:
        with attach("balanced", address=cluster.address) as job:
            assert texts(job) == expected
            event = job.rebalance(Lengths(((6, 20),) * 8))
            assert event["event"] == "re-balanced", event
            assert event["kv_pool_tokens"][0] == 32 < event["kv_pool_tokens"][1]
            record = registry.load_record("balanced")[1]
            assert record["events"][-1]["event"] == "re-balanced"
            assert registry.config_of(record).kv_cache_tokens == event["kv_pool_tokens"][1]
            assert job.config.kv_cache_tokens == event["kv_pool_tokens"][1]  # this handle too
            assert texts(job) == expected
            stats = job.serving_stats()
            assert (
                stats["rebalances"] == 1 and stats["kv_blocks"] == event["kv_pool_tokens"][1] // 16
            )
    finally:
        registry.unload("balanced")
    wait_gpus_free(3)


def _holdings() -> tuple[set[str], dict[str, str]]:
    """The cluster's named actors and its placement groups that are not removed (id -> state)."""
    actors = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    groups = {
        group_id: entry["state"]
        for group_id, entry in ray.util.placement_group_table().items()
        if entry["state"] != "REMOVED"
    }
    return actors, groups


def test_a_load_never_harms_another_of_its_name_or_beside_it(cluster, tmp_path) -> None:
    """Two loads named `dup` at once: one wins and stays usable, the other fails at once naming
    the name (before: it waited for GPUs, failed, and its clean-up removed the winner by
    name). A load that cannot get GPUs (the winner holds two of the three) leaves the cluster
    as it found it: no record, no worker, no placement group. `unload` of a load whose record
    died cleans up by name."""
    import dataclasses
    import threading

    import torch

    from coordinator.config import JobConfig
    from coordinator.planning.planner import PlanError
    from coordinator.runtime.launch import attach, launch
    from coordinator.tools.reference import reference_logits

    checkpoint = str(
        make_checkpoint(
            tmp_path / "ckpt",
            tiny_shape(4),
        )
    )
    index = load_index(checkpoint)
    decoder = max(layer.nbytes for layer in index.layers if layer.kind == "decoder")
    # two GPUs hold it resident; one cannot (no host memory to offload to)
    config = JobConfig(
        checkpoint=checkpoint,
        address=cluster.address,
        gpu_memory_bytes=index.total_bytes // 2 + decoder,
        host_memory_bytes=1,
        nodes=f"{ray.get_runtime_context().get_node_id()}=2",  # two of the three GPUs
    )
    before = _holdings()
    results: dict[int, object] = {}

    def load(i: int) -> None:
        try:
            results[i] = launch(config, name="dup")
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    [winner] = [r for r in results.values() if not isinstance(r, Exception)]
    [error] = [r for r in results.values() if isinstance(r, Exception)]
    try:
        assert "a load named 'dup' already exists or is loading" in str(error)
        assert registry.list_loads() == ["dup"] and len(registry.named_groups("dup")) == 1
        winner.close()  # detaches
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
        with attach("dup", address=cluster.address) as job:
            assert len(job.plan.stages) == 2
            assert torch.equal(job.forward(ids), reference_logits(checkpoint, ids, num_threads=1))
        held = _holdings()

        # one GPU is free, and one cannot hold the model: refused, nothing left behind
        with pytest.raises(PlanError):
            launch(dataclasses.replace(config, nodes=""), name="greedy")
        assert _holdings() == held and registry.list_loads() == ["dup"]

        # the record dies (its process, say): unload still finds the load by its name
        ray.kill(ray.get_actor(registry.record_name("dup"), namespace="offload-coordinator"))
        assert main(["unload", "dup", "--address", cluster.address]) == 0
    finally:
        registry.forget("dup")
    wait_gpus_free(3)
    assert _holdings() == before


def test_a_loader_killed_mid_load_leaves_nothing(cluster, tmp_path) -> None:
    """`load --name` killed with -9 while its workers load (held at their first chunk): its
    record sees its loader gone and unloads what the load made (workers, placement group, the
    record itself), so no GPU stays held by a load nobody finishes."""
    import os
    import time
    from pathlib import Path

    from worker.loader import HOLD_ENV

    checkpoint = make_checkpoint(
        tmp_path / "ckpt",
        tiny_shape(2),
    )
    job = tmp_path / "held.yaml"
    job.write_text(
        f"overrides:\n  - match: {{hostname: '*'}}\n"
        f"    env: {{{HOLD_ENV}: '{tmp_path / 'never'}'}}\n"
    )
    before = _holdings()
    offloadctl = str(Path(sys.executable).with_name("offloadctl"))
    loader = subprocess.Popen(
        [
            offloadctl,
            "load",
            "--checkpoint",
            str(checkpoint),
            "--config",
            str(job),
            "--name",
            "orphan",
            "--gpu-memory",
            "64MiB",
            "--address",
            cluster.address,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RAY_ADDRESS": cluster.address},
    )
    try:
        deadline = time.monotonic() + 120
        while True:  # its workers started and recorded, held at their first chunk
            try:
                record = registry.load_record("orphan", loading=True)[1]
                if record["workers"] and registry.named_groups("orphan"):
                    break
            except registry.LoadNotFoundError:
                pass
            assert loader.poll() is None and time.monotonic() < deadline, "the load never started"
            time.sleep(0.2)
        assert record["state"] == "loading"
        loader.kill()
        loader.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _holdings() != before or registry.list_loads():
            assert time.monotonic() < deadline, f"still held: {_holdings()}"
            time.sleep(0.5)
    finally:
        if loader.poll() is None:
            loader.kill()
        registry.forget("orphan")
    wait_gpus_free(3)
