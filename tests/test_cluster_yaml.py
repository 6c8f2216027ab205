"""cluster.yaml and the on-prem example pass Ray's own offline launcher validation and our
invariants; each kind of mistake is caught with a message that names it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from coordinator.cli import main
from coordinator.tools.cluster_yaml import check_cluster_config, pinned_ray_version

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster.yaml"


def test_pyproject_pins_the_ray_the_configs_install() -> None:
    assert pinned_ray_version() == "2.60.0"


@pytest.mark.parametrize("path", [CLUSTER, ROOT / "examples" / "onprem.yaml"])
def test_shipped_configs_pass(path: Path) -> None:
    result = check_cluster_config(path)
    assert result.ok, result.errors


def test_cluster_yaml_has_the_two_gpu_kinds() -> None:
    types = yaml.safe_load(CLUSTER.read_text())["available_node_types"]
    labels = {name: t.get("labels", {}) for name, t in types.items() if t["resources"].get("GPU")}
    assert {l["offload-pin-memory"] for l in labels.values()} == {"auto", "off"}  # noqa: E741
    assert len(labels) >= 2


def _gpu_type(config: dict) -> dict:
    return config["available_node_types"]["gpu_h100"]


MUTATIONS: list[tuple[str, Callable[[dict], None], str]] = [
    (
        "unknown top-level key",
        lambda c: c.update(offload_policy="off"),
        "Additional properties are not allowed ('offload_policy'",
    ),
    (
        "unknown key in a node type",
        lambda c: _gpu_type(c).update(pin_memory="off"),
        "'pin_memory' was unexpected",
    ),
    (
        "label that is not a string",
        lambda c: _gpu_type(c)["labels"].update({"gpu-family": 7}),
        "7 is not of type 'string'",
    ),
    (
        "missing pin label",
        lambda c: _gpu_type(c)["labels"].pop("offload-pin-memory"),
        "'gpu_h100' has GPUs but no 'offload-pin-memory' label",
    ),
    (
        "invalid pin label",
        lambda c: _gpu_type(c)["labels"].update({"offload-pin-memory": "maybe"}),
        "label offload-pin-memory='maybe' is not a valid pin setting",
    ),
    (
        "other Ray version",
        lambda c: c.update(setup_commands=['pip install "ray[default]==2.59.0"']),
        "install Ray 2.59.0 but pyproject.toml pins 2.60.0",
    ),
    (
        "no Ray pin",
        lambda c: c.update(setup_commands=["pip install ray"]),
        "do not install a pinned Ray",
    ),
    (
        "public dashboard",
        lambda c: c.update(
            head_start_ray_commands=[
                "export RAY_AUTH_MODE=token; ray start --head --dashboard-host=0.0.0.0"
            ]
        ),
        "bind the dashboard to all interfaces",
    ),
    (
        "public dashboard, quoted",
        lambda c: c.update(
            head_start_ray_commands=[
                'export RAY_AUTH_MODE=token; ray start --head --dashboard-host="0.0.0.0"'
            ]
        ),
        "bind the dashboard to all interfaces",
    ),
    ("no provider", lambda c: c.pop("provider"), "the required key 'provider' is missing"),
    (
        "Ray's aws defaults",
        lambda c: c.pop("head_start_ray_commands"),
        "bind the dashboard to all interfaces",
    ),
    (
        "token auth off on workers",
        lambda c: c.update(worker_start_ray_commands=["ray start --address=$RAY_HEAD_IP:6379"]),
        "worker_start_ray_commands do not export RAY_AUTH_MODE=token",
    ),
    (
        "token not shipped",
        lambda c: c["file_mounts"].pop("~/.ray/auth_token"),
        "do not copy ~/.ray/auth_token",
    ),
]


@pytest.mark.parametrize(("what", "mutate", "message"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mistakes_are_caught(tmp_path: Path, what: str, mutate, message: str) -> None:
    config = copy.deepcopy(yaml.safe_load(CLUSTER.read_text()))
    mutate(config)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    result = check_cluster_config(path)
    assert not result.ok
    assert any(message in error for error in result.errors), result.errors


def test_check_cluster_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-cluster", str(CLUSTER)]) == 0
    out = capsys.readouterr().out
    assert "cluster.yaml: ok" in out and "placeholder" in out  # the arm64 image to fill in
    bad = tmp_path / "bad.yaml"
    bad.write_text(CLUSTER.read_text().replace("offload-pin-memory: auto", "offload-pin: auto"))
    assert main(["check-cluster", str(bad)]) == 1
    assert "no 'offload-pin-memory' label" in capsys.readouterr().out
