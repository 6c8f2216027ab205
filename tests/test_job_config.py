"""Job configuration: sizes, YAML files, unknown keys, per-node overrides and their allowlist."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import (
    ConfigError,
    JobConfig,
    NodeMatch,
    Override,
    env_for_node,
    job_config_from_dict,
    load_job_config,
    node_env,
    parse_bytes,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        (4096, 4096),
        ("6MiB", 6 * 2**20),
        ("1.5 GiB", 3 * 2**29),
        ("2gb", 2 * 10**9),
        ("512k", 512_000),
        ("0", 0),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "5 MiBs", "-1", "1e3", "MiB", -5, "1.5", "0.5b"])
def test_parse_bytes_rejects_garbage(text: str | int) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_bytes"):
        parse_bytes(text, field_name="gpu_memory_bytes")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_yaml_job_with_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
checkpoint: ckpt/
gpu_memory_bytes: 6MiB
prefetch_step: 2
overrides:
  - match: {labels: {gpu: gh200}}
    env: {OFFLOAD_PIN_MEMORY: "off"}
  - match: {hostname: "edge-*"}
    env: {VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY: 1}
""",
    )
    config = load_job_config(path)
    assert config.gpu_memory_bytes == 6 * 2**20 and config.prefetch_step == 2
    assert config.overrides[0] == Override(
        match=NodeMatch(labels={"gpu": "gh200"}), env={"OFFLOAD_PIN_MEMORY": "off"}
    )
    assert config.overrides[1].env == {"VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY": "1"}


def test_command_line_values_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "checkpoint: a/\nprefetch_step: 2\ngpus: 2\n")
    config = load_job_config(path, prefetch_step=3, gpus=None, checkpoint=None)
    assert (config.checkpoint, config.prefetch_step, config.gpus) == ("a/", 3, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "checkpoint: a/\ngpu_memory: 5MiB\n",
            "unknown key 'gpu_memory'; did you mean 'gpu_memory_bytes'",
        ),
        ("checkpoint: a/\nprefetch: 2\n", "did you mean 'prefetch_step'"),
        ("checkpoint: a/\nzzz: 1\n", "valid keys: checkpoint"),
        (
            "checkpoint: a/\noverrides:\n  - mach: {}\n    env: {OFFLOAD_X: '1'}\n",
            "did you mean 'match'",
        ),
        (
            "checkpoint: a/\noverrides:\n  - match: {label: {}}\n    env: {OFFLOAD_X: '1'}\n",
            "did you mean 'labels'",
        ),
        (
            "checkpoint: a/\noverrides:\n  - match: {}\n    env: {PATH: /evil}\n",
            "'PATH' is not allowed",
        ),
        ("checkpoint: a/\noverrides:\n  - match: {}\n    env: {}\n", "at least one variable"),
        ("checkpoint: a/\ngpu_memory_bytes: much\n", "gpu_memory_bytes='much' is not a size"),
        ("- just\n- a list\n", "a mapping"),
        ("gpus: 2\n", "checkpoint"),
        ("checkpoint: a/\nprefetch_step: 0\n", "prefetch_step=0"),
        ("checkpoint: a/\nbackend: gpu\n", "backend='gpu'"),
        (
            "checkpoint: a/\nresident_weights: fp4\n",
            "resident_weights='fp4' must be one of auto, stored, wide",
        ),
        (
            "checkpoint: a/\nhost_experts: always\n",
            "host_experts='always' must be one of off, auto",
        ),
        ("checkpoint: a/\ngpus: 2\naddress: auto\n", "cannot be combined"),
        ("checkpoint: [unclosed\n", "cannot read job config"),
        ("checkpoint: a/\nmax_batch: -1\n", "max_batch=-1 must be >= 1"),
        ("checkpoint: a/\nsnapshot_interval_s: .nan\n", "snapshot_interval_s=nan must be a finite"),
        ("checkpoint: a/\nforward_timeout_s: .inf\n", "forward_timeout_s=inf must be a finite"),
    ],
)
def test_bad_job_files_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job_config(write(tmp_path, text))
    assert message in str(info.value)


def test_yaml_off_is_off_where_a_key_takes_off(tmp_path: Path) -> None:
    """YAML reads `off` as false: `host_experts: off` still means "off"."""
    assert load_job_config(write(tmp_path, "checkpoint: a/\nhost_experts: off\n")).host_experts == (
        "off"
    )
    assert load_job_config(
        write(tmp_path, "checkpoint: a/\nhost_experts: auto\n")
    ).host_experts == ("auto")


def test_env_for_node_matches_and_later_overrides_win() -> None:
    overrides = (
        Override(match=NodeMatch(labels={"gpu": "gh200"}), env={"OFFLOAD_PIN_MEMORY": "off"}),
        Override(match=NodeMatch(hostname="gh-*"), env={"OFFLOAD_PIN_MEMORY": "auto"}),
        Override(match=NodeMatch(node_id="abc"), env={"OFFLOAD_OTHER": "1"}),
    )
    assert env_for_node(overrides, node_id="x", hostname="h100-1", labels={"gpu": "h100"}) == {}
    assert env_for_node(overrides, node_id="x", hostname="h100-1", labels={"gpu": "gh200"}) == {
        "OFFLOAD_PIN_MEMORY": "off"
    }
    assert env_for_node(overrides, node_id="abc", hostname="gh-7", labels={"gpu": "gh200"}) == {
        "OFFLOAD_PIN_MEMORY": "auto",
        "OFFLOAD_OTHER": "1",
    }
    both = NodeMatch(labels={"gpu": "gh200"}, hostname="gh-*")  # every criterion must hold
    assert not both.matches(node_id="x", hostname="h100-1", labels={"gpu": "gh200"})


def test_job_config_validates_fields() -> None:
    with pytest.raises(ConfigError, match="gpu_memory_bytes=0"):
        JobConfig(checkpoint="a", gpu_memory_bytes=0)
    with pytest.raises(ConfigError, match="cpus_per_worker"):
        JobConfig(checkpoint="a", cpus_per_worker=0)
    assert job_config_from_dict({"checkpoint": "a", "reserve_bytes": "1KiB"}).reserve_bytes == 1024
    # a queue that cannot hold a whole batch would refuse, as busy, a request that fits
    with pytest.raises(ConfigError, match=r"max_queue=0 must be >= max_batch=4.*--max-queue"):
        JobConfig(checkpoint="a", max_batch=4, max_queue=0)
    # a KV pool must hold one sequence of max_seq_len; no sequence is expected past it
    with pytest.raises(ConfigError, match=r"kv_cache_tokens=100 cannot hold one sequence of "):
        JobConfig(checkpoint="a", max_seq_len=128, kv_cache_tokens=100)
    with pytest.raises(ConfigError, match=r"expected_seq_len=200 exceeds max_seq_len=128"):
        JobConfig(checkpoint="a", max_seq_len=128, expected_seq_len=200)
    with pytest.raises(ConfigError, match=r"kv_cache_tokens=-1 must be >= 0"):
        JobConfig(checkpoint="a", max_seq_len=128, kv_cache_tokens=-1)
    assert JobConfig(checkpoint="a", max_seq_len=128, kv_cache_tokens=130).kv_blocks() == 9
    # the batch window delays a lone request's first token: bounded, and 0 turns it off
    for bad in (-0.001, 2.0, float("nan")):
        with pytest.raises(ConfigError, match=r"batch_wait_s=.* must be between 0 .* and 1"):
            JobConfig(checkpoint="a", batch_wait_s=bad)
    assert JobConfig(checkpoint="a", batch_wait_s=0).batch_wait_s == 0
    assert JobConfig(checkpoint="a", max_batch=3, max_seq_len=20).kv_blocks() == 6
    stored = JobConfig(checkpoint="a", resident_weights="stored")
    assert stored.plan_options().resident_weights == "stored"  # the planner gets it


PIN, VLLM = "OFFLOAD_PIN_MEMORY", "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY"


def test_node_env_precedence_override_over_label() -> None:
    overrides = (Override(match=NodeMatch(labels={"pool": "b"}), env={PIN: "on"}),)
    labelled = {"offload-pin-memory": "off"}
    assert node_env(overrides, node_id="n", hostname="h", labels=labelled) == (
        {PIN: "off", VLLM: "0"},
        {PIN: "node label", VLLM: "node label"},
    )
    assert node_env(overrides, node_id="n", hostname="h", labels={**labelled, "pool": "b"}) == (
        {PIN: "on", VLLM: "0"},
        {PIN: "job override", VLLM: "job override"},
    )
    assert node_env(overrides, node_id="n", hostname="h", labels={}) == ({}, {})


# Where each source may say something: (the job's override, the node's label, the node's own
# environment) -> whether the node pins. A discrete CUDA GPU with headroom, where the probe
# alone would pin.
DECIDED = [
    # issue 57: the label said on, the job said no with vLLM's variable: the job decides
    (({VLLM: "1"}, "on", {}), False, VLLM),
    (({VLLM: "1"}, None, {PIN: "on"}), False, VLLM),  # over the node's own variable too
    (({PIN: "auto"}, None, {VLLM: "1"}), True, "probe"),  # the job: let the probe decide
    (({PIN: "on"}, "off", {VLLM: "1"}), True, PIN),
    (({}, "on", {VLLM: "1"}), True, PIN),  # the label over the node's own variable
    (({}, "auto", {VLLM: "1"}), True, "probe"),
    (({}, None, {VLLM: "1"}), False, VLLM),  # only the node says: it decides
    (({}, None, {PIN: "on", VLLM: "1"}), True, PIN),  # one source: its own rule
    (({}, None, {}), True, "probe"),
]


@pytest.mark.parametrize(("sources", "pin", "source"), DECIDED)
def test_pinning_is_decided_by_the_highest_source_that_says_anything(sources, pin, source):
    from test_policy import X86_H100

    from offload.policy import decide_pinning

    job, label, own = sources
    overrides = (Override(match=NodeMatch(), env=job),) if job else ()
    labels = {"offload-pin-memory": label} if label is not None else {}
    env, _ = node_env(overrides, node_id="n", hostname="h", labels=labels)
    decision = decide_pinning({**own, **env}, X86_H100)  # the node's env, then the job's
    assert (decision.pin, decision.source) == (pin, source)


def test_invalid_pin_label_names_the_node_and_label() -> None:
    with pytest.raises(
        ConfigError, match=r"node gh-3 \(abcdef12\): label offload-pin-memory='sometimes'"
    ):
        node_env(
            (), node_id="abcdef1234", hostname="gh-3", labels={"offload-pin-memory": "sometimes"}
        )


def test_a_named_loads_record_keeps_every_kind_of_override() -> None:
    """A load's record stores its config, and its keeper and every `attach` read it back: an
    override that matches by labels only (or every node) must come back as it was. It came
    back with `hostname: null`, which the reader refuses, so the keeper never started."""
    from coordinator.config import job_config_from_dict
    from coordinator.runtime.registry import _config_dict

    config = JobConfig(
        checkpoint="c",
        overrides=(
            Override(match=NodeMatch(), env={"OFFLOAD_SIMULATED_GPU_MEMORY": "2GiB"}),
            Override(match=NodeMatch(labels={"pool": "gh200"}), env={"OFFLOAD_PIN_MEMORY": "0"}),
            Override(match=NodeMatch(hostname="gpu-*", node_id="ab"), env={"OFFLOAD_X": "1"}),
        ),
    )
    assert job_config_from_dict(_config_dict(config)) == config
