"""Offline checks of a Ray cluster-launcher config: `offloadctl check-cluster cluster.yaml`.

First Ray's own validation, the part `ray up` runs before it contacts a cloud (`prepare_config`
fills Ray's provider defaults, `validate_config` applies the launcher's JSON schema and its
cross-field rules), then our invariants: GPU node types carry the labels the coordinator reads,
the Ray version installed on the nodes is the one pyproject.toml pins, the dashboard stays on
loopback and token authentication stays on.
"""

from __future__ import annotations

import copy
import importlib.metadata
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from coordinator.config import PIN_LABEL
from offload.policy import parse_pin_mode

REQUIRED_GPU_LABELS = ("gpu-family", PIN_LABEL)
_RAY_PIN = re.compile(r"ray\[[^\]]*\]==([0-9][0-9.]*)|\bray==([0-9][0-9.]*)")


@dataclass(slots=True)
class ClusterCheck:
    path: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def pinned_ray_version() -> str | None:
    """The Ray version pyproject.toml pins (from the installed distribution's metadata)."""
    try:
        requires = importlib.metadata.requires("offload-coordinator") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requires:
        match = re.match(r"ray(\[[^\]]*\])?\s*==\s*([0-9][0-9.]*)", requirement)
        if match:
            return match.group(2)
    return None


def _ray_validation(raw: dict) -> tuple[dict | None, str | None]:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        full = prepare_config(copy.deepcopy(raw))
        validate_config(full)
    except Exception as exc:  # jsonschema.ValidationError, ValueError, RuntimeError
        message = getattr(exc, "message", None) or str(exc).splitlines()[0]
        if isinstance(exc, KeyError):  # Ray reads a key the file lacks
            message = f"the required key {exc.args[0]!r} is missing"
        where = "/".join(str(p) for p in getattr(exc, "absolute_path", []) or [])
        return None, f"Ray's launcher rejects it{f' at {where}' if where else ''}: {message}"
    return full, None


def _commands(config: dict, key: str) -> str:
    return "\n".join(str(c) for c in config.get(key) or [])


def _check_node_types(config: dict, check: ClusterCheck) -> None:
    for name, node_type in (config.get("available_node_types") or {}).items():
        if float((node_type.get("resources") or {}).get("GPU", 0)) <= 0:
            continue
        labels = node_type.get("labels") or {}
        for label in REQUIRED_GPU_LABELS:
            if label not in labels:
                check.errors.append(
                    f"node type {name!r} has GPUs but no {label!r} label; the coordinator "
                    f"reads it (add labels: {{{label}: ...}})"
                )
        if PIN_LABEL in labels:
            try:
                parse_pin_mode(str(labels[PIN_LABEL]), variable=f"{name}: label {PIN_LABEL}")
            except ValueError as exc:
                check.errors.append(str(exc))
        image = str((node_type.get("node_config") or {}).get("ImageId", ""))
        if "REPLACE" in image:
            check.warnings.append(f"node type {name!r}: ImageId {image!r} is a placeholder")


def _check_ray_version(config: dict, check: ClusterCheck) -> None:
    wanted = pinned_ray_version()
    setup = _commands(config, "setup_commands")
    found = {a or b for a, b in _RAY_PIN.findall(setup)}
    if not found:
        check.errors.append(
            f"setup_commands do not install a pinned Ray (want ray[default]=={wanted}): "
            "nodes would run whatever Ray their image has"
        )
    elif wanted and found != {wanted}:
        check.errors.append(
            f"setup_commands install Ray {', '.join(sorted(found))} but pyproject.toml pins "
            f"{wanted}; make them agree"
        )


def _check_security(config: dict, check: ClusterCheck) -> None:
    head = _commands(config, "head_start_ray_commands")
    hosts = [h.strip("'\"") for h in re.findall(r"--dashboard-host[= ](\S+)", head)]
    if any(h in ("0.0.0.0", "::", "[::]") for h in hosts):
        check.errors.append(
            "head_start_ray_commands bind the dashboard to all interfaces "
            f"(--dashboard-host={hosts[0]}); use --dashboard-host=127.0.0.1 and `ray dashboard`"
        )
    elif "ray start" in head and not hosts:
        check.warnings.append("head_start_ray_commands do not set --dashboard-host")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = _commands(config, key)
        if "ray start" in commands and "RAY_AUTH_MODE=token" not in commands:
            check.errors.append(
                f"{key} do not export RAY_AUTH_MODE=token: token authentication would be off "
                "on those nodes (Ray 2.60 enables it only where asked)"
            )
    if "auth_token" not in " ".join(map(str, (config.get("file_mounts") or {}).keys())):
        check.errors.append(
            "file_mounts do not copy ~/.ray/auth_token to the nodes; they could not join a "
            "token-authenticated head"
        )


def check_cluster_config(path: str | Path) -> ClusterCheck:
    check = ClusterCheck(path=str(path))
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        check.errors.append(f"cannot read: {exc}")
        return check
    if not isinstance(raw, dict):
        check.errors.append("a cluster config is a mapping")
        return check
    full, error = _ray_validation(raw)
    if error:
        check.errors.append(error)
        return check
    _check_node_types(full, check)
    _check_ray_version(full, check)
    _check_security(full, check)
    return check
