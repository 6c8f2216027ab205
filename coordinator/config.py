"""The job configuration: one frozen `JobConfig`, from CLI flags or a YAML file (same fields).

Per-node overrides put environment variables on the workers of matching nodes through Ray's
`runtime_env`; only an allowlist of variables may be set that way, so a job file cannot change
arbitrary process settings on the cluster.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from offload.errors import ConfigError
from offload.policy import PIN_ENV, VLLM_DISABLE_PIN_ENV, parse_pin_mode
from offload.sizes import parse_bytes
from worker.names import (
    COMPUTE_DTYPE_NAMES,
    DEFAULT_BLOCK_SIZE,
    EXPERT_FETCHES,
    HOST_EXPERTS,
    OFFLOAD_DTYPES,
    RESIDENT_WEIGHTS,
    blocks_for,
)

# The node label that sets a node's pin policy (on | off | auto), e.g. in cluster.yaml.
PIN_LABEL = "offload-pin-memory"
PIN_VARIABLES = (PIN_ENV, VLLM_DISABLE_PIN_ENV)  # what says anything about pinning
PIN_NEUTRAL = {PIN_ENV: "auto", VLLM_DISABLE_PIN_ENV: "0"}  # says: the next rule decides
# Prefixes of variables a job may set on its workers.
OVERRIDE_ALLOWED_PREFIXES = ("OFFLOAD_", "VLLM_WEIGHT_OFFLOADING_")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeMatch:
    """Selects nodes; every given criterion must hold."""

    labels: dict[str, str] = field(default_factory=dict)
    hostname: str | None = None  # a glob, e.g. "gh200-*"
    node_id: str | None = None

    def matches(self, *, node_id: str, hostname: str, labels: dict[str, str]) -> bool:
        if self.node_id is not None and self.node_id != node_id:
            return False
        if self.hostname is not None and not fnmatch.fnmatchcase(hostname, self.hostname):
            return False
        return all(labels.get(k) == v for k, v in self.labels.items())


@dataclass(frozen=True, kw_only=True, slots=True)
class Override:
    match: NodeMatch
    env: dict[str, str]

    def __post_init__(self) -> None:
        if not self.env:
            raise ConfigError("an override needs at least one variable in env")
        for name, value in self.env.items():
            if not name.startswith(OVERRIDE_ALLOWED_PREFIXES):
                raise ConfigError(
                    f"override variable {name!r} is not allowed; a job may only set variables "
                    f"starting with {', '.join(OVERRIDE_ALLOWED_PREFIXES)}"
                )
            if not isinstance(value, str):
                raise ConfigError(f"override {name}={value!r}: values must be strings")
            if name == PIN_ENV:  # checked here, so `plan` catches it before Ray starts
                try:
                    parse_pin_mode(value, variable=f"override {PIN_ENV}")
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None


def env_for_node(
    overrides: tuple[Override, ...], *, node_id: str, hostname: str, labels: dict[str, str]
) -> dict[str, str]:
    """The variables the job's overrides set on one node's workers; later overrides win."""
    env: dict[str, str] = {}
    for override in overrides:
        if override.match.matches(node_id=node_id, hostname=hostname, labels=labels):
            env.update(override.env)
    return env


def node_env(
    overrides: tuple[Override, ...], *, node_id: str, hostname: str, labels: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """(env, origin of each variable) for one node's workers.

    Pinning is decided per decision, not per variable: the highest source that says anything
    about it decides, whichever of its variables (OFFLOAD_PIN_MEMORY, vLLM's
    VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY) it uses. The job's override > the node's
    `offload-pin-memory` label > the node's own environment (inherited by the workers, so not
    listed here) > the probe. A source that decides also sets the pin variable it left out
    to its neutral value (auto, 0), so a lower source's setting of that one cannot win
    (`offload.policy` weighs OFFLOAD_PIN_MEMORY over vLLM's variable within one source).
    """
    env: dict[str, str] = {}
    origins: dict[str, str] = {}
    job = env_for_node(overrides, node_id=node_id, hostname=hostname, labels=labels)
    pinning = [name for name in PIN_VARIABLES if name in job]
    if pinning:
        source, said = "job override", {name: job[name] for name in pinning}
    elif PIN_LABEL in labels:
        value = labels[PIN_LABEL]
        try:
            parse_pin_mode(value, variable=f"label {PIN_LABEL}")
        except ValueError as exc:
            raise ConfigError(f"node {hostname} ({node_id[:8]}): {exc}") from None
        source, said = "node label", {PIN_ENV: value}
    else:
        source, said = None, {}
    if source is not None:
        for name in PIN_VARIABLES:
            env[name] = said.get(name, PIN_NEUTRAL[name])
            origins[name] = source
    for name, value in job.items():
        if name not in PIN_VARIABLES:
            env[name] = value
            origins[name] = "job override"
    return env, origins


def _check_type(key: str, hint: str, value: object) -> None:
    """A ConfigError naming the key, the type and the value unless `value` has type `hint` (a
    JobConfig annotation: str, int, float, "X | None", tuple[Override, ...])."""
    wanted = hint.removesuffix(" | None")
    if value is None and wanted != hint:
        return
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "tuple[Override, ...]": isinstance(value, tuple)
        and all(isinstance(v, Override) for v in value),
    }.get(wanted, True)
    if not ok:
        raise ConfigError(
            f"{key} must be {wanted}{' or empty' if wanted != hint else ''}, got "
            f"{_kind(value)} {value!r}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    checkpoint: str
    address: str | None = None  # None: an embedded local Ray; "auto" or host:port: join one
    gpus: int = 0  # embedded Ray only: logical GPUs to create (0: the real ones)
    gpu_memory_bytes: int | None = None  # per-GPU budget (required without CUDA)
    host_memory_bytes: int | None = None  # per-node budget for offloaded weights
    # Per GPU, kept free for a step's activations and workspace; None: computed from the model
    # and the batch where the GPUs are real (coordinator/planning/reserve.py), 0 simulated.
    reserve_bytes: int | None = None
    # KV cache reserved on the GPUs for generation: up to max_batch sequences in flight of up
    # to max_seq_len tokens each (prompt + new). max_seq_len 0: none reserved, and the job
    # cannot generate. max_batch 0 ("auto"): the largest batch whose KV cache fits beside the
    # planned weights (coordinator/planning/batch_size.py), resolved when the job is planned.
    max_batch: int = 1
    max_seq_len: int = 0
    # The KV pool on each GPU, in tokens (positions of every running sequence, in blocks of
    # worker.spec.DEFAULT_BLOCK_SIZE): 0 (auto), what the plan leaves beside the weights
    # (coordinator/planning/batch_size.py), resolved when the job is planned. It must hold one
    # sequence of max_seq_len; sequences take blocks as they grow, so more than
    # pool / max_seq_len of them run at once when they are shorter. And the length a sequence
    # is expected to reach (0: a quarter of max_seq_len), which auto max_batch and the
    # throughput search size the pool by.
    kv_cache_tokens: int = 0
    expected_seq_len: int = 0
    # A sequence reuses the full KV blocks of an earlier one whose tokens start the same (a
    # system prompt, a chat history) instead of computing them again (off: always computed)
    prefix_caching: bool = True
    # Sequences that may wait for a KV slot (beyond: busy, HTTP 429); prompt tokens per prefill
    # step (a long prompt is prefilled in chunks, decodes of others between them); micro-batches
    # the running sequences are split into (0: one when any stage offloads, as each micro-batch
    # brings the offloaded layers in again; else one per stage, so that every stage has work).
    max_queue: int = 1024
    prefill_tokens: int = 512
    micro_batches: int = 0
    # An idle engine given a request waits this long for others to start in its first step
    # (0: never waits): requests sent at once then decode in step.
    batch_wait_s: float = 0.005
    # What the plan maximises: "latency" (the slowest stage, for one sequence's step) or
    # "throughput" (decode tokens/s: it also chooses max_batch when 0 and micro_batches when 0),
    # with each sequence's time between tokens at most max_token_latency_s (0: no bound).
    objective: str = "latency"
    max_token_latency_s: float = 0.0
    # Pipelines serving at once, each on its own GPUs (throughput only; `serve` runs them as Ray
    # Serve replicas): 1, a count dividing the GPUs, or 0 (auto: the count with the most
    # tokens/s, serve's default). And the GPUs a job may plan on: "NODE_ID=N,..." (Ray node
    # ids, N GPUs of each; empty: every GPU of every GPU node), which `serve` sets per replica.
    replicas: int = 1
    nodes: str = ""
    prefetch_step: int = 1
    backend: str = "auto"
    # How offloaded weights are kept in host memory and cross the link (worker.spec's
    # OFFLOAD_DTYPES): "auto" as the checkpoint stores them (block FP8 in 8 bits), "none" at
    # the model's width, "fp8" / "int8" every offloaded matrix in 8 bits, dequantized on the
    # device after each copy (prefetch backend).
    offload_dtype: str = "auto"
    # How an offloaded MoE layer's experts cross the link (EXPERT_FETCHES): "layer", the whole
    # layer, prefetched while earlier layers compute; "routed", only the experts the step's
    # router chose, once it has (fewer bytes, not overlapped: best at small batches); "auto",
    # the planner's choice per stage at the plan's batch.
    expert_fetch: str = "auto"
    # How a quantized checkpoint's resident weights sit on the GPUs (RESIDENT_WEIGHTS): "stored"
    # as the checkpoint stores them (FP8 blocks, MXFP4), each layer's dequantized just in time
    # into one buffer; "wide" dequantized at load, at the model's width (twice FP8's bytes);
    # "auto" stored where every node's GPUs compute in FP8 and the plan at width offloads.
    resident_weights: str = "auto"
    # Rows each offloaded experts module of a routed stage caches on the device: -1 (auto) as
    # many as the memory the plan leaves holds, 0 none, N at most N (PlanOptions.expert_cache).
    expert_cache: int = -1
    # Routed stages' small experts calls computed on the host, reading the experts where they
    # are in host memory (HOST_EXPERTS): "auto" where the node's measured rates say the host is
    # sooner than the link (PlanOptions.host_experts), "off" never.
    host_experts: str = "off"
    # The dtype the model loads and computes in: "auto" (the checkpoint's: config.json's dtype,
    # else its tensors'), or float32 / bfloat16 / float16, converted while reading.
    dtype: str = "auto"
    overrides: tuple[Override, ...] = ()
    cpus_per_worker: int = 1
    attn_implementation: str | None = None  # None: transformers chooses, as from_pretrained does
    load_timeout_s: float = 900.0
    # How long the cluster may take to reserve every planned GPU at once (a placement group):
    # past it, nothing is started and the job says which GPUs it waited for.
    placement_timeout_s: float = 120.0
    forward_timeout_s: float = 300.0
    # Each worker snapshots its memory this often (0: only on request); a named load's record
    # publishes the latest snapshots as Ray gauges at the same pace.
    snapshot_interval_s: float = 10.0
    # A named load's keeper checks its workers this often and recovers lost ones with no
    # driver attached (0: only when a driver finds one lost).
    watch_interval_s: float = 5.0
    # A load whose KV pool the cost model chose re-balances it against its resident weights
    # for the lengths its requests come to, at most once per this many seconds and never
    # while requests wait (coordinator.runtime.rebalance; 0: never on its own).
    rebalance_interval_s: float = 600.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, str(f.type), getattr(self, f.name))
        if not self.checkpoint:
            raise ConfigError("checkpoint: a checkpoint directory is required")
        for name in (
            "gpus",
            "reserve_bytes",
            "max_seq_len",
            "kv_cache_tokens",
            "expected_seq_len",
            "max_queue",
            "micro_batches",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.max_batch < 0:
            raise ConfigError(
                f"max_batch={self.max_batch} must be >= 1 (sequences at once), or "
                "0 (auto: as many as fit beside the weights)"
            )
        if self.prefill_tokens < 1:
            raise ConfigError(f"prefill_tokens={self.prefill_tokens} must be >= 1")
        if self.expected_seq_len > self.max_seq_len:
            raise ConfigError(
                f"expected_seq_len={self.expected_seq_len} exceeds max_seq_len="
                f"{self.max_seq_len}: no sequence grows past max_seq_len (0: a quarter of it)"
            )
        if 0 < self.kv_cache_tokens < self.max_seq_len:
            raise ConfigError(
                f"kv_cache_tokens={self.kv_cache_tokens} cannot hold one sequence of "
                f"max_seq_len={self.max_seq_len}: a request that long would wait forever; give "
                "at least max_seq_len tokens (or 0: max_batch x max_seq_len)"
            )
        if self.max_queue < self.max_batch:
            raise ConfigError(
                f"max_queue={self.max_queue} must be >= max_batch={self.max_batch}: a request "
                "as large as the batch must be able to wait for it (raise --max-queue)"
            )
        for name in (
            "load_timeout_s",
            "forward_timeout_s",
            "placement_timeout_s",
            "snapshot_interval_s",
            "watch_interval_s",
            "rebalance_interval_s",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(
                    f"{name}={getattr(self, name)} must be a finite number of seconds"
                )
        for name in ("gpu_memory_bytes", "host_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name}={value} must be > 0")
        if not 1 <= self.prefetch_step <= 64:
            raise ConfigError(f"prefetch_step={self.prefetch_step} must be in 1..64")
        if self.cpus_per_worker < 1:
            raise ConfigError(f"cpus_per_worker={self.cpus_per_worker} must be >= 1")
        if self.dtype not in ("auto", *COMPUTE_DTYPE_NAMES):
            raise ConfigError(
                f"dtype={self.dtype!r} must be auto, {', '.join(COMPUTE_DTYPE_NAMES)}"
            )
        if self.replicas < 0:
            raise ConfigError(
                f"replicas={self.replicas} must be >= 1, or 0 (auto: as many as "
                "give the most tokens/s)"
            )
        if self.replicas != 1 and self.objective != "throughput":
            raise ConfigError(
                f"replicas={self.replicas}: replicas serve for throughput; set "
                "objective throughput (--objective throughput), or replicas 1"
            )
        self.node_gpus()  # a malformed `nodes` fails here, naming it
        if self.objective not in ("latency", "throughput"):
            raise ConfigError(f"objective={self.objective!r} must be latency or throughput")
        if not (math.isfinite(self.batch_wait_s) and 0 <= self.batch_wait_s <= 1):
            raise ConfigError(
                f"batch_wait_s={self.batch_wait_s} must be between 0 (no wait) and 1 second: "
                "it delays the first token of a request that reaches an idle engine"
            )
        if not (math.isfinite(self.max_token_latency_s) and self.max_token_latency_s >= 0):
            raise ConfigError(
                f"max_token_latency_s={self.max_token_latency_s} must be a finite "
                "number of seconds >= 0 (0: no bound)"
            )
        if self.max_token_latency_s and self.objective != "throughput":
            raise ConfigError(
                f"max_token_latency_s={self.max_token_latency_s} bounds the "
                "throughput objective: set objective throughput "
                "(--objective throughput), or drop the bound"
            )
        if self.backend not in ("auto", "prefetch", "uva"):
            raise ConfigError(f"backend={self.backend!r} must be auto, prefetch or uva")
        if self.offload_dtype not in OFFLOAD_DTYPES:
            raise ConfigError(
                f"offload_dtype={self.offload_dtype!r} must be one of {', '.join(OFFLOAD_DTYPES)}"
            )
        if self.expert_fetch not in EXPERT_FETCHES:
            raise ConfigError(
                f"expert_fetch={self.expert_fetch!r} must be one of {', '.join(EXPERT_FETCHES)}"
            )
        if isinstance(self.expert_cache, bool) or not isinstance(self.expert_cache, int):
            raise ConfigError(f"expert_cache={self.expert_cache!r} must be an int (-1: auto)")
        if self.expert_cache < -1:
            raise ConfigError(
                f"expert_cache={self.expert_cache} must be >= -1 (-1: as many rows as the "
                "memory the plan leaves holds, 0: none)"
            )
        if self.host_experts not in HOST_EXPERTS:
            raise ConfigError(
                f"host_experts={self.host_experts!r} must be one of {', '.join(HOST_EXPERTS)}"
            )
        if self.resident_weights not in RESIDENT_WEIGHTS:
            raise ConfigError(
                f"resident_weights={self.resident_weights!r} must be one of "
                f"{', '.join(RESIDENT_WEIGHTS)}"
            )
        if self.offload_dtype in ("fp8", "int8") and self.backend == "uva":
            raise ConfigError(
                f"offload_dtype={self.offload_dtype} keeps offloaded weights in 8 bits and "
                "dequantizes them after each copy, which the uva backend (reading them in place) "
                "cannot: use backend prefetch (--backend prefetch), or offload_dtype auto"
            )
        if self.gpus and self.address is not None:
            raise ConfigError(
                f"gpus={self.gpus} creates logical GPUs on an embedded Ray; it cannot be combined "
                f"with address={self.address!r}, whose GPUs are real"
            )
        for name in ("load_timeout_s", "forward_timeout_s", "placement_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.watch_interval_s < 0:
            raise ConfigError(
                f"watch_interval_s={self.watch_interval_s} must be >= 0 (0: no keeper checks)"
            )
        if self.rebalance_interval_s < 0:
            raise ConfigError(
                f"rebalance_interval_s={self.rebalance_interval_s} must be >= 0 (0: the KV pool "
                "is re-balanced only when asked)"
            )
        if self.snapshot_interval_s < 0:
            raise ConfigError(
                f"snapshot_interval_s={self.snapshot_interval_s} must be >= 0 (0: on request only)"
            )

    def node_gpus(self) -> dict[str, int]:
        """`nodes` as {node id: GPUs}; empty: no restriction."""
        out: dict[str, int] = {}
        for entry in filter(None, (e.strip() for e in self.nodes.split(","))):
            node, _, count = entry.partition("=")
            if not node or not count.isdigit() or int(count) < 1 or node in out:
                raise ConfigError(
                    f"nodes={self.nodes!r}: each entry must be NODE_ID=N (a Ray "
                    f"node id once, N >= 1 GPUs), got {entry!r}"
                )
            out[node] = int(count)
        return out

    def kv_blocks(self) -> int:
        """Blocks of the KV pool on each GPU (0: no generation, max_seq_len 0)."""
        if not self.max_seq_len:
            return 0
        if self.kv_cache_tokens:
            return blocks_for(self.kv_cache_tokens)
        return self.max_batch * blocks_for(self.max_seq_len)

    def plan_options(self):
        """The planner's options this job sets (the rest: the planner's defaults)."""
        from coordinator.planning.planner import PlanOptions  # planning imports this module

        return PlanOptions(
            reserve_bytes=self.reserve_bytes or 0,  # None: job_options computes it
            prefetch_step=self.prefetch_step,
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            kv_tokens=self.kv_blocks() * DEFAULT_BLOCK_SIZE if self.kv_cache_tokens else 0,
            expected_seq_len=self.expected_seq_len,
            micro_batches=self.micro_batches or 1,
            objective=self.objective,
            offload_dtype=self.offload_dtype,
            expert_fetch=self.expert_fetch,
            resident_weights=self.resident_weights,
            expert_cache=self.expert_cache,
            host_experts=self.host_experts,
        )


_SIZE_FIELDS = {"gpu_memory_bytes", "host_memory_bytes", "reserve_bytes"}
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(JobConfig))


def _unknown_key(key: str, valid: tuple[str, ...], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def _mapping(raw: object, where: str, *, scalars: bool = True) -> dict[str, str]:
    """A YAML mapping of names to scalar values, as strings; a list or a nested value is an
    error naming where it is."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping (name: value), got {_kind(raw)} {raw!r}")
    out = {}
    for key, value in raw.items():
        if scalars and (isinstance(value, dict | list) or value is None):
            raise ConfigError(
                f"{_key_path(where, key)}: expected a single value, got {_kind(value)}"
            )
        out[str(key)] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _key_path(where: str, key: object) -> str:
    """`where.key`, or `where['key']` when the key is not plain text (a newline or a space in
    it would break the one-line error)."""
    text = str(key)
    return (
        f"{where}.{text}"
        if text.isprintable() and not any(c.isspace() for c in text)
        else (f"{where}[{text!r}]")
    )


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing"}.get(
        type(value), f"a {type(value).__name__}"
    )


def _override_from_dict(raw: object, where: str) -> Override:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: an override is a mapping with 'match' and 'env'")
    for key in raw:
        if key not in ("match", "env"):
            raise _unknown_key(key, ("match", "env"), where)
    match = raw.get("match") or {}
    if not isinstance(match, dict):
        raise ConfigError(f"{where}.match: expected a mapping, got {_kind(match)}")
    for key in match:
        if key not in ("labels", "hostname", "node_id"):
            raise _unknown_key(key, ("labels", "hostname", "node_id"), f"{where}.match")
    criteria: dict[str, object] = {}
    if "labels" in match:
        criteria["labels"] = _mapping(match["labels"], f"{where}.match.labels")
    for key in ("hostname", "node_id"):
        if key in match:
            if not isinstance(match[key], str):
                raise ConfigError(
                    f"{where}.match.{key}: expected a string, got {_kind(match[key])}"
                )
            criteria[key] = match[key]
    env = _mapping(raw.get("env") or {}, f"{where}.env")
    return Override(match=NodeMatch(**criteria), env=env)


def job_config_from_dict(raw: dict, *, where: str = "job config") -> JobConfig:
    """Build a JobConfig from plain data (YAML), checking each key and its type: an unknown key
    names the closest valid one, a wrong type names the key, the type and the value."""
    values = {}
    for key, value in raw.items():
        if key not in FIELD_NAMES:
            raise _unknown_key(key, FIELD_NAMES, where)
        if key in _SIZE_FIELDS and value is not None:
            value = parse_bytes(value, field_name=key)
        elif key == "host_experts" and value is False:  # YAML reads `off` (and `no`) so
            value = "off"
        elif key == "overrides":
            if not isinstance(value, list | tuple | type(None)):
                raise ConfigError(
                    f"{where}: overrides must be a list of {{match, env}}, got {_kind(value)}"
                )
            value = tuple(
                _override_from_dict(item, f"{where}: overrides[{i}]")
                for i, item in enumerate(value or [])
            )
        values[key] = value
    if not values.get("checkpoint"):
        raise ConfigError(
            f"{where}: no checkpoint: give --checkpoint DIR (or `checkpoint: DIR` in a --config "
            "job file)"
        )
    try:
        return JobConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_job_config(
    path: str | Path, defaults: dict | None = None, **cli_values: object
) -> JobConfig:
    """Read a YAML job file; values given on the command line (not None) win over the file,
    and the file over `defaults` (a command's own defaults, for keys neither sets)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read job config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a job config is a mapping of keys to values")
    raw.update({k: v for k, v in cli_values.items() if v is not None})
    return job_config_from_dict({**(defaults or {}), **raw}, where=str(path))
