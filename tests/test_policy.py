"""The pin policy, rule by rule, and every way its inputs can be wrong."""

from __future__ import annotations

import pytest

from offload import NodeProbe, PinningUnavailableError, decide_pinning
from offload.policy import (
    PIN_ENV,
    PIN_HEADROOM_FRACTION,
    VLLM_DISABLE_PIN_ENV,
    parse_pin_mode,
    resolve_backend,
)
from offload.probe import DeviceInfo

GIB = 2**30


def gpu(name: str = "NVIDIA H100 80GB HBM3", **kw) -> DeviceInfo:
    fields = dict(
        index=0,
        name=name,
        capability=(9, 0),
        total_memory_bytes=80 * GIB,
        integrated=False,
        pageable_memory_access=False,
        pageable_memory_access_uses_host_page_tables=False,
        host_register_supported=True,
    )
    fields.update(kw)
    return DeviceInfo(**fields)


X86_H100 = NodeProbe(
    cuda_available=True,
    devices=(gpu(),),
    host_total_bytes=512 * GIB,
    host_available_bytes=400 * GIB,
    cpu_arch="x86_64",
)
NO_CUDA = NodeProbe(cuda_available=False, host_available_bytes=20 * GIB, cpu_arch="x86_64")
WSL = NodeProbe(cuda_available=True, devices=(gpu("NVIDIA GeForce RTX 4090"),), is_wsl=True)
JETSON = NodeProbe(cuda_available=True, devices=(gpu("Orin", integrated=True),))
GH200 = NodeProbe(
    cuda_available=True,
    devices=(
        gpu(
            "NVIDIA GH200 480GB",
            pageable_memory_access=True,
            pageable_memory_access_uses_host_page_tables=True,
        ),
    ),
    host_available_bytes=400 * GIB,
    cpu_arch="aarch64",
)
NO_REGISTER = NodeProbe(cuda_available=True, devices=(gpu(host_register_supported=False),))


@pytest.mark.parametrize(
    ("env", "probe", "planned", "pin", "source"),
    [
        # auto (unset, explicit, blank) follows the probe
        ({}, X86_H100, 0, True, "probe"),
        ({PIN_ENV: "auto"}, X86_H100, 0, True, "probe"),
        ({PIN_ENV: "  "}, X86_H100, 0, True, "probe"),
        ({}, NO_CUDA, 0, False, "probe.cuda"),
        ({}, WSL, 0, False, "probe.wsl"),
        ({}, JETSON, 0, False, "probe.integrated_gpu"),
        ({}, GH200, 0, False, "probe.unified_memory"),
        # headroom: exactly at the limit pins, one byte over does not
        ({}, X86_H100, int(400 * GIB * PIN_HEADROOM_FRACTION), True, "probe"),
        ({}, X86_H100, int(400 * GIB * PIN_HEADROOM_FRACTION) + 1, False, "probe.host_memory"),
        # unknown available memory: the headroom rule cannot fire
        ({}, NodeProbe(cuda_available=True, devices=(gpu(),)), 10**15, True, "probe"),
        # explicit settings, every spelling
        *[({PIN_ENV: v}, X86_H100, 0, True, PIN_ENV) for v in ("on", "1", "true", "YES", " On ")],
        *[
            ({PIN_ENV: v}, X86_H100, 0, False, PIN_ENV)
            for v in ("off", "0", "False", "no", "OFF\n")
        ],
        # explicit on wins over the probe where pinning is possible but not advised
        ({PIN_ENV: "on"}, GH200, 0, True, PIN_ENV),
        ({PIN_ENV: "on"}, WSL, 0, True, PIN_ENV),
        ({PIN_ENV: "off"}, NO_CUDA, 0, False, PIN_ENV),
        # vLLM's switch
        ({VLLM_DISABLE_PIN_ENV: "1"}, X86_H100, 0, False, VLLM_DISABLE_PIN_ENV),
        ({VLLM_DISABLE_PIN_ENV: "true"}, X86_H100, 0, False, VLLM_DISABLE_PIN_ENV),
        ({VLLM_DISABLE_PIN_ENV: "0"}, X86_H100, 0, True, "probe"),
        ({VLLM_DISABLE_PIN_ENV: ""}, X86_H100, 0, True, "probe"),
        ({VLLM_DISABLE_PIN_ENV: "1", PIN_ENV: "auto"}, X86_H100, 0, False, VLLM_DISABLE_PIN_ENV),
        ({VLLM_DISABLE_PIN_ENV: "1", PIN_ENV: "on"}, X86_H100, 0, True, PIN_ENV),
        ({VLLM_DISABLE_PIN_ENV: "0", PIN_ENV: "off"}, X86_H100, 0, False, PIN_ENV),
    ],
)
def test_rules(env: dict, probe: NodeProbe, planned: int, pin: bool, source: str) -> None:
    decision = decide_pinning(env, probe, planned_bytes=planned)
    assert (decision.pin, decision.source) == (pin, source)
    assert decision.reason  # every decision says why


def test_reasons_name_what_decided() -> None:
    assert "WSL" in decide_pinning({}, WSL).reason
    assert "GH200" in decide_pinning({}, GH200).reason
    assert "Orin" in decide_pinning({}, JETSON).reason
    over = decide_pinning({}, X86_H100, planned_bytes=300 * GIB)
    assert "300.00 GiB" in over.reason and "400.00 GiB" in over.reason
    overridden = decide_pinning({VLLM_DISABLE_PIN_ENV: "1", PIN_ENV: "on"}, X86_H100)
    assert VLLM_DISABLE_PIN_ENV in overridden.reason
    forced = decide_pinning({PIN_ENV: "on"}, GH200)
    assert "unified memory" in forced.reason  # the override is honoured, the risk is stated


@pytest.mark.parametrize("value", ["maybe", "2", "enable", "o n", "auto-ish", "-1", "tru"])
def test_invalid_pin_env_is_an_error_naming_variable_value_and_choices(value: str) -> None:
    with pytest.raises(ValueError) as info:
        decide_pinning({PIN_ENV: value}, X86_H100)
    message = str(info.value)
    assert PIN_ENV in message and repr(value) in message and "auto" in message


@pytest.mark.parametrize("value", ["yes please", "2", "disable"])
def test_invalid_vllm_env_is_an_error(value: str) -> None:
    with pytest.raises(ValueError, match=VLLM_DISABLE_PIN_ENV):
        decide_pinning({VLLM_DISABLE_PIN_ENV: value}, X86_H100)


@pytest.mark.parametrize("probe", [NO_CUDA, NO_REGISTER])
def test_forcing_on_where_pinning_is_impossible_is_an_error(probe: NodeProbe) -> None:
    with pytest.raises(PinningUnavailableError, match=PIN_ENV):
        decide_pinning({PIN_ENV: "on"}, probe)


def test_negative_planned_bytes_is_rejected() -> None:
    with pytest.raises(ValueError, match="planned_bytes"):
        decide_pinning({}, X86_H100, planned_bytes=-1)


def test_parse_pin_mode_normalises() -> None:
    assert [parse_pin_mode(v) for v in (None, "", "AUTO", "1", "no")] == [
        "auto",
        "auto",
        "auto",
        "on",
        "off",
    ]


def test_decision_is_pure_and_serialisable() -> None:
    env = {PIN_ENV: "auto"}
    first = decide_pinning(env, X86_H100)
    assert decide_pinning(env, X86_H100) == first
    assert env == {PIN_ENV: "auto"}
    assert first.to_dict() == {"pin": True, "reason": first.reason, "source": "probe"}


@pytest.mark.parametrize("probe", [X86_H100, WSL, JETSON, GH200, NO_CUDA])
@pytest.mark.parametrize("planned", [0, 10**15])
def test_ray_tests_expect_what_the_policy_decides(probe: NodeProbe, planned: int) -> None:
    """The Ray tests check a probe-decided worker by its device (`assert_probe_decided_pin`):
    that expectation must hold for every decision the policy can make on either device, and
    fail for the other device's decision."""
    import torch
    from helpers import assert_probe_decided_pin

    from offload.host_store import decide_for_device

    on_cpu = decide_for_device({}, probe, planned, torch.device("cpu")).to_dict()
    assert_probe_decided_pin("cpu", on_cpu)
    with pytest.raises(AssertionError):
        assert_probe_decided_pin("cuda", on_cpu)
    if probe.cuda_available:  # a worker runs on "cuda" only where its process sees CUDA
        on_cuda = decide_for_device({}, probe, planned, torch.device("cuda")).to_dict()
        assert_probe_decided_pin("cuda", on_cuda)
        with pytest.raises(AssertionError):
            assert_probe_decided_pin("cpu", on_cuda)


@pytest.mark.parametrize(
    ("env", "probe", "planned", "reason"),
    [
        ({}, NO_CUDA, 0, "no CUDA device: nothing to pin for"),
        ({}, WSL, 0, "running under WSL, where pinned memory is capped and registration fails"),
        (
            {},
            NodeProbe(
                cuda_available=True,
                devices=(gpu("Orin", integrated=True), gpu("Orin NX", integrated=True)),
            ),
            0,
            "integrated GPU shares host memory (Orin, Orin NX): pinning only takes memory away "
            "from it",
        ),
        (
            {},
            NodeProbe(cuda_available=True, devices=GH200.devices * 2),
            0,
            "coherent unified memory (NVIDIA GH200 480GB, NVIDIA GH200 480GB): the GPU reads "
            "pageable memory "
            "through the host page tables, so pinning costs memory and buys nothing",
        ),
        (
            {},
            X86_H100,
            300 * GIB,
            "planned pinned bytes 300.00 GiB exceed 50% of available host memory (400.00 GiB)",
        ),
        ({}, X86_H100, 0, "discrete CUDA GPU with host memory headroom: pinned copies are fastest"),
        ({PIN_ENV: " Off "}, X86_H100, 0, f"{PIN_ENV}=Off"),
        (
            {PIN_ENV: "0", VLLM_DISABLE_PIN_ENV: "1"},
            X86_H100,
            0,
            f"{PIN_ENV}=0 (overrides {VLLM_DISABLE_PIN_ENV}=1)",
        ),
        ({PIN_ENV: "on"}, X86_H100, 0, f"{PIN_ENV}=on"),
        (
            {PIN_ENV: "yes"},
            WSL,
            0,
            f"{PIN_ENV}=yes; the probe would not pin: running under WSL, where pinned memory is "
            "capped and registration fails",
        ),
        ({VLLM_DISABLE_PIN_ENV: "1"}, X86_H100, 0, f"{VLLM_DISABLE_PIN_ENV}=1 (vLLM setting)"),
    ],
    ids=[
        "no-cuda",
        "wsl",
        "integrated",
        "coherent",
        "headroom",
        "discrete",
        "off",
        "off-over-vllm",
        "on",
        "on-against-probe",
        "vllm",
    ],
)
def test_each_rule_says_why_in_the_words_an_operator_reads(env, probe, planned, reason) -> None:
    """The reason is the policy's answer to "why" (`offloadctl status`, telemetry): each rule's
    words, the devices and the setting as the operator wrote it, and nothing else."""
    assert decide_pinning(env, probe, planned_bytes=planned).reason == reason


def test_the_headroom_rule_counts_every_planned_byte_and_only_planned_ones() -> None:
    """One planned byte on a node with one available byte is past the 50% headroom; no planned
    bytes (the default) never are."""
    tiny = NodeProbe(cuda_available=True, devices=(gpu(),), host_available_bytes=1)
    assert decide_pinning({}, tiny, planned_bytes=1).source == "probe.host_memory"
    assert decide_pinning({}, tiny).pin is True


def test_errors_name_every_device_and_every_allowed_value() -> None:
    two = NodeProbe(
        cuda_available=True,
        devices=(
            gpu("A100", host_register_supported=False),
            gpu("L4", host_register_supported=False),
        ),
    )
    with pytest.raises(PinningUnavailableError) as info:
        decide_pinning({PIN_ENV: "1"}, two)
    assert str(info.value).startswith(f"{PIN_ENV}=1 forces pinned host memory, but A100, L4 cannot")
    with pytest.raises(ValueError) as info:
        parse_pin_mode("maybe")
    assert "allowed values (case-insensitive): auto, on, off, 1, 0, true, false, yes, no" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("requested", "probe", "device", "expected"),
    [
        ("uva", X86_H100, "cuda", ("uva", "backend=uva requested")),
        (
            "auto",
            GH200,
            "cuda",
            (
                "uva",
                "auto: the GPU reads host memory through its page tables (coherent unified "
                "memory), so zero-copy access beats copying weights in",
            ),
        ),
        (
            "auto",
            GH200,
            "cpu",
            (
                "uva",
                "auto: the simulated coherent GPU reads host memory through its page tables "
                "(coherent unified memory), so zero-copy access beats copying weights in",
            ),
        ),
        (
            "auto",
            X86_H100,
            "cuda",
            ("prefetch", "auto: discrete GPU, weights are copied in ahead of use on a side stream"),
        ),
        (
            "auto",
            X86_H100,
            "cpu",
            ("prefetch", "auto: CPU device, weights are copied in ahead of use on a copy thread"),
        ),
    ],
)
def test_the_backend_auto_chooses_and_why(requested, probe, device, expected) -> None:
    assert resolve_backend(requested, probe, device_type=device) == expected
