"""The per-GPU worker: a plain class, run as a Ray actor inside `worker.actor.StageActor` (whose
module imports no torch), so tests can also drive it in-process.

Lifecycle: `prepare()` builds the stage on the meta device, gives resident layers real memory
and wraps the offloaded ones (their weights get arena space, no data yet); `load_chunk(i)` reads
one group of layers from the checkpoint straight into place (the driver shows progress between
chunks); `finish_load()` starts the prefetch and checks the device budget; then `forward(x)`.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import resource
import socket
import threading
import time
from collections.abc import Callable

import torch

from offload import OffloadConfig, create_offloader, probe_node
from offload.errors import ConfigError, LaunchError
from offload.factory import choose_backend
from offload.host_store import decide_for_device
from offload.policy import PIN_ENV, VLLM_DISABLE_PIN_ENV
from offload.probe import DECISION_STEPS, host_memory, process_rss
from offload.resident import StoredResidency
from offload.simulated import DeviceLedger, simulated_gpu_memory
from offload.stats import OffloadStats
from worker.batched import BatchRunner
from worker.guided import GuideBook
from worker.layout import (
    UnsupportedModelError,
    check_recurrent_support,
    hf_config_from_dict,
    model_class_for,
)
from worker.loader import TensorReader, hang_if_asked, hold_if_asked
from worker.node import probe_here, simulated_place
from worker.placement import Placement, held, materialize
from worker.reporting import Snapshots, device_memory, pin_decision, pin_origin, storage_bytes
from worker.snapshot import CopyCounters, StageSnapshot
from worker.spec import (
    OFFLOAD_UNITS,
    StageSpec,
    parameter_formats,
    stored_formats,
    torch_dtype_named,
)
from worker.stage import Stage, avoid_per_shape_attention_graphs
from worker.startup import settle
from worker.steps import Draw, StepRows, pack_out
from worker.wire import Packed, pack, unpack

LOAD_CHUNK_BYTES = 64 * 2**20  # progress granularity


# A reconfigure allocates its new arena beside the old one only where the host has this share
# of its bytes available beyond them (the rest: page cache, the process's own growth).
HOST_HEADROOM_FRACTION = 0.9


class WorkerError(LaunchError):
    """A worker could not load or run its stage; the message says which stage and why."""


class StageWorker:
    def __init__(
        self,
        spec: StageSpec,
        *,
        device: str | None = None,
        gpu_memory_bytes: int | None = None,
        num_threads: int | None = None,
        attn_implementation: str | None = None,
        snapshot_interval_s: float = 0.0,
    ) -> None:
        self.spec = spec
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.gpu_memory_bytes = gpu_memory_bytes
        self.attn_implementation = attn_implementation
        avoid_per_shape_attention_graphs(self.device)
        self.probe = probe_node(DECISION_STEPS)  # the node's rates come from probe_here()
        # Import the model's transformers modules now, with the process start, so `load_s`
        # measures loading (building the stage and reading its bytes) and nothing else.
        start = time.perf_counter()
        self._hf_config = hf_config_from_dict(
            spec.config,
            dtype=torch_dtype_named(spec.dtype),
            attn_implementation=attn_implementation,
        )
        model_class_for(self._hf_config)
        self.init_s = time.perf_counter() - start
        self.stage: Stage | None = None
        settle()  # imports done: the GC's own thresholds again (worker.startup)
        self._placement: Placement | None = None  # the stage's modules, offloader, loaded layers
        # Read with as many threads as the worker has CPUs (Ray's num_cpus for the actor).
        self._reader = TensorReader(
            spec.checkpoint_dir,
            threads=num_threads or 1,
            identities=spec.files,
            pin=self._may_pin(),
        )
        self._layer_specs = {layer.name: layer for layer in spec.layers}
        self._chunks: list[list[str]] = []  # layer names per chunk, to read from disk
        self._simulated = self._simulated_gpu()
        self._ready = False
        self._load_s = 0.0
        self._forward_s = 0.0
        self._forwards = 0
        self._batches = BatchRunner(self.device)  # generation steps and their KV slots
        self._batches.guide_book = GuideBook(spec.checkpoint_dir)  # guided rows, on need
        self._snapshots = Snapshots(
            self._snapshot,
            ready=lambda: self._ready,
            where=self._where,
            interval_s=snapshot_interval_s,
        )

    def _may_pin(self) -> bool:
        """Whether this node's decision pins host memory (its environment: the job's override,
        the node's label, its own variables; its probe), asked as for a buffer of no size: what
        the loader's staging buffer follows. A setting the offloader will refuse pins nothing
        here (the offloader says why when it decides)."""
        try:
            return decide_for_device(os.environ, self.probe, 0, self.device).pin
        except ConfigError:  # a bad value, or pinning forced where it cannot work
            return False

    def _simulated_gpu(self) -> tuple[DeviceLedger, int, int] | None:
        """The simulated GPU with a size that this worker's CPU stands in for
        (`offload.simulated`): its node's ledger, its index and its total; None on a real GPU,
        for simulated GPUs without a size, and outside a Ray actor."""
        if self.device.type != "cpu":
            return None
        total = simulated_gpu_memory(os.environ)
        place = simulated_place() if total is not None else None
        if place is None or not place[1]:
            return None
        ledger, indexes = place
        return ledger, indexes[0], total

    def _hold_simulated(self, held: int) -> None:
        """On a simulated GPU with a size, the loaded stage (`held` device bytes) must fit beside
        what the other processes there hold, as on a real GPU (where CUDA would fail the
        allocation); its bytes then go to the node's ledger, which the probes read."""
        if self._simulated is None:
            return
        ledger, index, total = self._simulated
        free = ledger.free(index, total, credit=(os.getpid(),))
        if held > free:
            raise WorkerError(
                f"{self._where()}: holds {held} bytes on simulated GPU {index}, of which other "
                f"processes hold {total - free} of its {total}; another load plans on the same "
                "GPU, or the plan's budget is too high: lower --gpu-memory"
            )
        ledger.hold(index, held)

    @property
    def offloader(self):
        return self._placement.offloader if self._placement is not None else None

    def _where(self) -> str:
        return f"stage {self.spec.stage} on {socket.gethostname()}"

    # loading
    def prepare(self) -> dict[int, int]:
        """Build the stage and place every parameter (first call only); returns the byte size
        of each chunk still to read, by chunk index: all of them at first, the rest after an
        interrupted load, none once loaded. So the driver can re-run a load that a lost worker
        interrupted without the others reading anything twice."""
        if self._placement is None:
            start = time.perf_counter()
            self._build(previous=None)
            self._load_s += time.perf_counter() - start
        return {
            i: sum(self._layer_specs[n].file_bytes for n in self._chunks[i])
            for i in self._unread_chunks()
        }

    def _unread_chunks(self) -> list[int]:
        """Chunks whose layers are not in place yet (a chunk is read whole)."""
        loaded = self._placement.loaded
        return [i for i, chunk in enumerate(self._chunks) if chunk[0] not in loaded]

    def reconfigure(self, spec: StageSpec) -> dict[int, int]:
        """Take a new stage after a re-plan. Layers this worker already holds move to their new
        place in memory (a layer resident before and after is adopted as is, no copy); only the
        others are left to read from disk. Returns the chunks to read, as `prepare` does."""
        start = time.perf_counter()
        previous = self._placement
        if previous is not None:
            previous.offloader.synchronize()  # no copy into a slot may still be in flight
        self.spec = spec
        self._layer_specs = {layer.name: layer for layer in spec.layers}
        self._build(previous=previous)
        self._load_s += time.perf_counter() - start
        return self.prepare()

    def _build(self, previous: Placement | None) -> None:
        spec = self.spec
        if any(layer.state_bytes for layer in spec.layers):  # this node's transformers
            try:
                check_recurrent_support(spec.config.get("model_type", "?"))
            except UnsupportedModelError as exc:
                raise WorkerError(f"{self._where()}: {exc}") from None
        stage = Stage(self._hf_config, [layer.name for layer in spec.layers])
        modules = stage.layer_modules()
        names = list(modules)
        unknown = sorted(set(spec.offloaded) - set(names))
        if unknown:
            raise WorkerError(f"{self._where()}: offloaded layers {unknown} are not in this stage")
        unit = OFFLOAD_UNITS[spec.offload_unit]
        if spec.offloaded:
            config = OffloadConfig(
                backend=spec.backend,
                layers=tuple(names.index(n) for n in spec.offloaded),
                prefetch_step=spec.prefetch_step,
                param_filter=unit,
                routed_experts=spec.expert_fetch == "routed",
                expert_cache=spec.expert_cache if spec.expert_fetch == "routed" else 0,
                host_expert_rows=spec.host_expert_rows if spec.expert_fetch == "routed" else 0,
            )
        else:
            config = OffloadConfig(backend="none")
        formats = self._offload_formats(stage, config)
        stored = self._stored_formats(stage, unit)
        carried = previous.loaded & set(names) if previous is not None else set()
        # a layer whose form changes (8 bits on one side only, on the device or in host
        # memory) is read again: neither way round is exact (a resident FP8 layer holds its
        # dequantized weights, an 8-bit one lost what quantizing dropped)
        carried = {n for n in carried if previous.held_formats(n) == held(formats, stored, n)}
        # Host memory: the new arena is allocated while the old one still holds what it hands
        # over, unless the node cannot hold both (a survivor of a re-plan that offloads more
        # was OOM-killed so): then the old arena goes first, and its layers are read again.
        host_first = previous is not None and self._frees_host_first(previous)
        if host_first:
            carried -= set(previous.spec.offloaded)
        # adopted as they are: resident layers at width (stored ones are copied: their
        # parameters view the old stage's dequantization buffer)
        kept_resident = {
            n
            for n in carried
            if n not in spec.offloaded and n not in previous.spec.offloaded and not stored.get(n)
        }
        if previous is not None:  # free what leaves this worker before allocating what arrives
            # the KV pool first: its sequences start again anyway (finish_load allocates the
            # new stage's pool once its layers are in place), and it may be the largest part;
            # then the old prefetch slots (copies of the old arena, which the moves read)
            self._batches.reset()
            previous.offloader.release_device_buffers()
            if host_first:  # its arena and slots go now: nothing is copied from them
                previous.offloader.detach(restore=False)
            for name, module in previous.modules.items():
                if name not in carried and name not in previous.spec.offloaded:
                    module.to("meta")
        for name, module in modules.items():
            kept = stored.get(name, {})
            if name in kept_resident:  # the old tensors themselves, no copy
                module.load_state_dict(previous.modules[name].state_dict(), assign=True)
            elif name not in spec.offloaded and not kept:
                module.to_empty(device=self.device)
            elif name not in spec.offloaded:  # but for its stored matrices (`residency`)
                materialize(module, lambda param, kept=kept: param not in kept, self.device)
            elif unit is not None:  # the part outside the offload unit stays on the device
                materialize(
                    module,
                    lambda param, kept=kept: not re.search(unit, param) and param not in kept,
                    self.device,
                )
        residency = StoredResidency(self.device, spec.stored_expert_capacity)
        residency.keep({modules[name]: kept for name, kept in stored.items() if kept})
        stage.init_buffers(self.device)
        offloader = create_offloader(
            config,
            device=self.device,
            probe=self.probe,
            formats={
                f"{names.index(name)}.{local}": fmt
                for name, by_local in formats.items()
                for local, fmt in by_local.items()
            },
        )
        if spec.offloaded and spec.backend_reason:  # the plan resolved "auto" for this node
            offloader.backend_reason = spec.backend_reason
        offloader.wrap_modules(list(modules.values()))
        placement = Placement(
            spec,
            stage.layout,
            modules,
            offloader,
            loaded=set(carried),
            formats=formats,
            residency=residency,
            stored=stored,
        )
        with torch.no_grad():
            for name in sorted(carried - kept_resident):  # moved between device and host
                for tensor in self._layer_specs[name].tensors:
                    placement.destination(name, tensor).copy_(previous.destination(name, tensor))
        if previous is not None:
            previous.offloader.detach(restore=False)  # its arena and slots go, nothing restored
            previous.residency.close()
        self.stage, self._placement = stage, placement
        self._chunks = self._make_chunks([n for n in names if n not in carried])
        self._ready = False
        self._snapshots.restart()

    def _frees_host_first(self, previous: Placement) -> bool:
        """Whether the old stage's arena must go before the new one is allocated: this host
        has less memory available than HOST_HEADROOM_FRACTION of the new arena's bytes."""
        if not previous.spec.offloaded or not self.spec.offloaded:
            return False
        unit = self.spec.offload_unit
        new = sum(self._layer_specs[n].unit_bytes(unit) for n in self.spec.offloaded)
        _, available = host_memory()
        return new > available * HOST_HEADROOM_FRACTION

    def _offload_formats(self, stage: Stage, config: OffloadConfig) -> dict[str, dict]:
        """The offloaded parameters kept in 8 bits (`worker.spec.parameter_formats` under the
        job's offload dtype), by layer and name within it. The prefetch backend dequantizes
        them after each copy; UVA computes on host memory as stored, so under "auto" an FP8
        checkpoint's offloaded weights are dequantized while read there, and an explicit
        fp8 or int8 is refused by the offloader."""
        spec = self.spec
        if not spec.offloaded:
            return {}
        backend, _ = choose_backend(config, self.device, self.probe)
        if backend != "prefetch" and spec.offload_dtype in ("auto", "none"):
            return {}
        formats = {}
        for name in spec.offloaded:
            layer = self._layer_specs[name]
            found = parameter_formats(layer.unit_tensors(spec.offload_unit), spec.offload_dtype)
            if found:
                formats[name] = {
                    stage.layout.local_name(name, target): fmt for target, fmt in found.items()
                }
        return formats

    def _stored_formats(self, stage: Stage, unit: str | None) -> dict[str, dict]:
        """The device-resident parameters kept as the checkpoint stores them
        (`StageSpec.resident_stored`: `worker.spec.stored_formats`), by layer and name within
        it: a resident layer's quantized matrices, and those an offloaded layer keeps outside
        its offload unit; an offloaded unit's are the offloader's."""
        spec = self.spec
        if not spec.resident_stored:
            return {}
        found = {}
        for layer in spec.layers:
            if layer.name in spec.offloaded and unit is None:
                continue
            by_local = {
                stage.layout.local_name(layer.name, target): fmt
                for target, fmt in stored_formats(layer.tensors).items()
            }
            if layer.name in spec.offloaded:
                by_local = {n: f for n, f in by_local.items() if not re.search(unit, n)}
            if by_local:
                found[layer.name] = by_local
        return found

    def _make_chunks(self, names: list[str]) -> list[list[str]]:
        chunks: list[list[str]] = []
        size = 0
        for name in names:
            nbytes = self._layer_specs[name].file_bytes
            if not chunks or (chunks[-1] and size + nbytes > LOAD_CHUNK_BYTES):
                chunks.append([])
                size = 0
            chunks[-1].append(name)
            size += nbytes
        return chunks

    def load_chunk(self, index: int) -> int:
        """Read chunk `index` from disk into place; returns the bytes read (0 when the chunk
        was read already)."""
        placement = self._placement
        if self._chunks[index][0] in placement.loaded:
            return 0
        hold_if_asked()  # tests only: OFFLOAD_TEST_HOLD_LOAD
        start = time.perf_counter()
        before = self._reader.stats.bytes_read
        try:
            with torch.no_grad():
                self._reader.read_many(
                    [
                        (tensor, placement.destination(layer_name, tensor))
                        for layer_name in self._chunks[index]
                        for tensor in self._layer_specs[layer_name].tensors
                    ]
                )
        except (OSError, ValueError, KeyError) as exc:
            raise WorkerError(f"{self._where()}: loading failed: {exc}") from exc
        placement.loaded.update(self._chunks[index])
        self._load_s += time.perf_counter() - start
        return self._reader.stats.bytes_read - before

    def finish_load(self) -> StageSnapshot:
        """Start the prefetch and check the device budget; once ready, just a report."""
        if self._ready:
            return self.report()
        if self._placement is None:
            raise WorkerError(f"{self._where()}: finish_load before prepare")
        missing = self._unread_chunks()
        if missing:
            raise WorkerError(f"{self._where()}: finish_load before chunks {missing} were read")
        self._reader.close()
        start = time.perf_counter()
        self.offloader.post_init()
        # Ready means ready: the first prefetches have landed, so the memory reported (and the
        # first forward's latency) is that of the steady state.
        self.offloader.synchronize()
        spec = self.spec
        if spec.kv_slots and spec.kv_blocks:  # the planned KV pool, inside the check below
            self._batches.allocate(
                self.stage,
                num_blocks=spec.kv_blocks,
                block_size=spec.kv_block_size,
                num_slots=spec.kv_slots,
                hidden_size=self._hf_config.hidden_size,
                dtype=torch_dtype_named(spec.dtype),
            )
            self.offloader.synchronize()
        self._load_s += time.perf_counter() - start
        device_bytes = self.device_bytes()
        if self.gpu_memory_bytes is not None and device_bytes > self.gpu_memory_bytes:
            raise WorkerError(
                f"{self._where()}: holds {device_bytes} device bytes (of which KV cache "
                f"{self.kv_cache_bytes()}), over its budget of {self.gpu_memory_bytes}; offload "
                "more layers, lower --max-batch or --max-seq-len, or raise --gpu-memory"
            )
        self._check_reserve()
        self._hold_simulated(device_bytes)
        self._ready = True
        return self.report()

    def _check_reserve(self) -> None:
        """On a real GPU, the plan's reserve must be free once the stage holds its weights, slots
        and KV pool: a stage that cannot run its largest step fails its load, with the numbers,
        never a request with an out-of-memory error."""
        if self.device.type != "cuda" or not self.spec.reserve_bytes:
            return
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if free + cached < self.spec.reserve_bytes:
            raise WorkerError(
                f"{self._where()}: loaded, {free + cached} bytes of the GPU's {total} are free "
                f"(of which {cached} cached by PyTorch), less than the plan's reserve of "
                f"{self.spec.reserve_bytes} bytes for a step's activations and workspace; "
                "another process uses the GPU, or the plan's budget is too high: lower "
                "--gpu-memory, --max-batch, --max-seq-len or --prefill-tokens"
            )

    def load(self) -> StageSnapshot:
        """prepare + every chunk + finish, for callers that need no progress."""
        for index in self.prepare():
            self.load_chunk(index)
        return self.finish_load()

    # running
    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Token ids (first stage) or the previous stage's hidden states in; hidden states, or
        the logits of the last `logits_to_keep` positions (0: all) from the last stage. No KV
        cache: a whole pass (generation runs `batch_step`)."""
        self._require_ready()
        start = time.perf_counter()
        to_device = lambda t: t.to(self.device) if t is not None else None  # noqa: E731
        # inference_mode, not just no_grad: no version counters or view tracking on the
        # activations, 4-6% of a decode step of a small model on one CPU thread
        with torch.inference_mode():
            out = self.stage(
                to_device(x),
                attention_mask=to_device(attention_mask),
                position_ids=to_device(position_ids),
                logits_to_keep=logits_to_keep,
            )
        out = out.cpu()
        self._count_forward(start)
        return out

    def _require_ready(self) -> None:
        if not self._ready:
            raise WorkerError(f"{self._where()}: forward before load")

    def _count_forward(self, start: float | None = None) -> None:
        """One forward more; its time since `start`, or the batch runner's own last step."""
        elapsed = self._batches.last_step_s if start is None else time.perf_counter() - start
        self._forward_s += elapsed
        self._forwards += 1

    def step(
        self,
        x: Packed | torch.Tensor,
        attention_mask: Packed | torch.Tensor | None = None,
        position_ids: Packed | torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> Packed:
        """`forward` for calls across Ray: tensors in and out as `wire.pack` arrays (the
        driver's and the previous stage's), which Ray moves far more cheaply than tensors."""
        out = self.forward(unpack(x), unpack(attention_mask), unpack(position_ids), logits_to_keep)
        return pack(out)

    def claim(self, owner: tuple[str, int], take: bool = False) -> None:
        """Make `owner` (engine id, epoch) the one engine whose generation steps this stage
        runs (`BatchRunner.claim`); any other engine's step, or an older epoch's, is refused."""
        self._require_ready()
        self._batches.claim(owner, take=take)

    def release(self, owner: tuple[str, int]) -> None:
        """The engine `owner` closed: its claim goes (`BatchRunner.release`)."""
        self._batches.release(owner)

    def batch_step(
        self, rows: StepRows, x: Packed | torch.Tensor, draw: Draw | None = None, wire: bool = True
    ) -> Packed | torch.Tensor:
        """One generation step of a micro-batch (`worker.batched`): every row at once, each
        in its own KV slot; hidden states out, or from the last stage each row's next token.
        `wire`: packed for Ray (`worker.wire`); a caller in this process takes the tensor."""
        self._require_ready()
        hang_if_asked()  # tests only: OFFLOAD_TEST_HANG_STEP
        out = self._batches.step(self.stage, rows, unpack(x), draw)
        self._count_forward()
        return pack_out(out) if wire else out

    def batch_ring(
        self,
        batches: list[tuple[StepRows, Packed | torch.Tensor, Draw]],
        count: int,
        downstream: tuple = (),
        timeout_s: float = 300.0,
        yield_every_s: float = 0.0,
        wire: bool = True,
        stop: threading.Event | None = None,
    ):
        """Up to `count` decode steps of each micro-batch of `batches` driven from here, the
        first stage (`BatchRunner.ring`): each step goes through this stage and then the
        `downstream` ones, actor to actor, and the last stage's tokens come back here as the
        next step's input, the micro-batches taking turns so that every stage has one to work
        on. Yields lists of (micro-batch, tokens: packed when `wire`), one per step: a step's
        tokens go out at once when the last went out `yield_every_s` ago or more, else with the
        next. Called through Ray as a streaming generator, where each item costs ~0.35 ms (on a
        model whose step takes 2 ms, one item a step was a sixth of the step): `RING_YIELD_S`
        (12 ms) there; in process, 0 (every step at once, so that a cut burst computes nothing
        more). `stop`, in process only: the driver's cut (`BatchRunner.ring`): no step more is
        sent, those under way are still yielded."""
        self._require_ready()
        hang_if_asked()  # tests only: OFFLOAD_TEST_HANG_STEP
        batches = [(rows, unpack(x), draw) for rows, x, draw in batches]
        ready: list[tuple[int, Packed]] = []
        last = 0.0
        steps = self._batches.ring(self.stage, batches, count, downstream, timeout_s, stop)
        for m, tokens in steps:
            self._count_forward()  # this stage's own part of the step
            ready.append((m, pack_out(tokens) if wire else tokens))
            if time.perf_counter() - last >= yield_every_s:
                yield ready
                ready, last = [], time.perf_counter()
        if ready:
            yield ready

    def kv_cache_bytes(self) -> int:
        return self._batches.nbytes()

    # reporting
    def device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        # CPU stand-in for a GPU: the bytes behind the stage's parameters (resident + slots)
        # and its KV caches
        if self.stage is None:
            return 0
        host = self.offloader.host_tensors() if self.offloader is not None else None
        stored = self._placement.residency.stored_bytes if self._placement is not None else 0
        # (the stored parameters view the dequantization buffer, which storage_bytes counts;
        # the offloader's staging buffer and expert caches no parameter views)
        held = self.offloader.unviewed_device_bytes() if self.offloader is not None else 0
        return storage_bytes(self.stage, host) + stored + held + self.kv_cache_bytes()

    def history(self, since: float = 0.0) -> list[StageSnapshot]:
        """The periodic snapshots taken after time `since` (seconds since the epoch)."""
        return self._snapshots.history(since)

    def latest(self) -> StageSnapshot:
        """The last periodic snapshot, or a fresh one when none was taken yet."""
        return self._snapshots.latest()

    def report(self) -> StageSnapshot:
        """A snapshot of this worker now: memory, offloading, pinning, load and run times."""
        return self._snapshots.take()

    def _snapshot(self, since_last: Callable[[OffloadStats], CopyCounters]) -> StageSnapshot:
        offloader = self.offloader
        stats = offloader.stats() if offloader is not None else OffloadStats(backend="none")
        residency = self._placement.residency if self._placement is not None else None
        if residency is not None and residency.stored_bytes:  # as stored, and their buffer
            stats = dataclasses.replace(
                stats,
                resident_bytes=stats.resident_bytes - residency.wide_bytes + residency.stored_bytes,
                buffer_bytes=stats.buffer_bytes + residency.buffer_bytes,
            )
        decision = pin_decision(offloader, self.probe, self.device)
        _, available = host_memory()
        free, total = device_memory(self.device, self.gpu_memory_bytes, self.device_bytes())
        return StageSnapshot(
            stage=self.spec.stage,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            cpu_arch=platform.machine(),
            device=str(self.device),
            # Ray gives each actor its GPU through CUDA_VISIBLE_DEVICES (logical GPUs too).
            gpu=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            layers=tuple(layer.name for layer in self.spec.layers),
            offloaded=tuple(self.spec.offloaded),
            offload_unit=self.spec.offload_unit,
            offload_format=self._placement.offload_format() if self._placement else "",
            resident_format=residency.describe() if residency is not None else "",
            expert_layers=tuple(
                (self.spec.layers[index].name, hits, misses, nbytes)
                for index, hits, misses, nbytes in stats.expert_layers
            ),
            backend=offloader.backend if offloader is not None else "none",
            backend_reason=offloader.backend_reason if offloader is not None else "",
            pin=decision,
            pin_origin=pin_origin(decision, self.spec),
            env={k: os.environ[k] for k in (PIN_ENV, VLLM_DISABLE_PIN_ENV) if k in os.environ},
            device_total_bytes=total,
            device_used_bytes=self.device_bytes(),
            device_free_bytes=free,
            host_rss_bytes=process_rss(),
            host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            host_available_bytes=available,
            bytes_read=self._reader.stats.bytes_read,
            quantization_error=self._reader.stats.quantization_error,
            init_s=self.init_s,
            load_s=self._load_s,
            forward_s=self._forward_s,
            forwards=self._forwards,
            kv_cache_bytes=self.kv_cache_bytes(),
            requests=self._batches.last_rows,
            stats=stats,
            since_last=since_last(stats),
            time=time.time(),
            probe_errors=tuple(self.probe.errors),
        )

    def node_probe(self, model: tuple[dict, str, int] | None = None) -> dict:
        """This node's probe and pin decision (and, with `model`, its compute profile), as the
        runtime's probe task reports them, with this worker's GPU as a re-plan sees it: what
        its own stage holds there counts as free, since the new plan replaces it."""
        # cached_only: no layer allocated beside the stage
        result = probe_here(model=model, cached_only=True, credit=(os.getpid(),))
        probe = result["probe"]
        if self.device.type == "cuda" and probe.devices:
            index = self.device.index if self.device.index is not None else 0
            own = torch.cuda.memory_reserved(self.device)
            result["probe"] = dataclasses.replace(
                probe,
                devices=tuple(
                    dataclasses.replace(d, free_memory_bytes=d.free_memory_bytes + own)
                    if d.index == index and d.free_memory_bytes is not None
                    else d
                    for d in probe.devices
                ),
            )
        return result

    def ping(self) -> int:
        """Liveness check for the driver: answers with this process's pid."""
        return os.getpid()

    def close(self) -> None:
        self._snapshots.stop()
        if self._simulated is not None:
            self._simulated[0].release(self._simulated[1])
        self._reader.close()
        if self.offloader is not None:
            self.offloader.detach(restore=False)  # the stage goes with it: nothing to restore
            self._placement.residency.close()
        self.stage, self._placement, self._ready = None, None, False
