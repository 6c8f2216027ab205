"""Whatever is wrong with a checkpoint or a job file, `offloadctl plan` (which checks everything
`load` would, without Ray) ends with one short message and exit 2, never a traceback.

Hypothesis mutates a valid sharded checkpoint and a valid job file: files truncated, bytes of
headers overwritten, files replaced by directories, dangling links or link loops, JSON and YAML
values replaced by values of other types. A mutation that leaves a usable checkpoint may plan
(exit 0); anything else must be exit 2 with one line of at most 2,000 characters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.cli import main
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

MAX_MESSAGE_CHARS = 2000
JOB = {
    "checkpoint": None,
    "gpus": 2,
    "gpu_memory_bytes": "1MiB",
    "prefetch_step": 1,
    "dtype": "auto",
    "overrides": [{"match": {"labels": {"gpu": "h100"}}, "env": {"OFFLOAD_PIN_MEMORY": "auto"}}],
}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    shape = CheckpointShape(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_shard_bytes=20_000,
    )
    return make_checkpoint(tmp_path_factory.mktemp("valid") / "ckpt", shape)


def mutate_file(path: Path, how: str, data: st.DataObject) -> None:
    if how == "truncate":
        size = path.stat().st_size
        os.truncate(path, data.draw(st.integers(0, max(size - 1, 0)), label="length"))
    elif how == "overwrite":
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, min(len(raw), 400)), label="at")
        patch = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
        raw[at : at + len(patch)] = patch
        path.write_bytes(bytes(raw))
    elif how == "directory":
        path.unlink()
        path.mkdir()
    elif how == "dangling link":
        path.unlink()
        path.symlink_to(path.parent / "no-such-file")
    elif how == "link loop":
        path.unlink()
        path.symlink_to(path.name)
    elif how == "delete":
        path.unlink()
    elif how == "json document":
        path.write_text(json.dumps(data.draw(json_values, label="document")))
    elif how == "json value":
        value = json.loads(path.read_text())
        key = data.draw(st.sampled_from(sorted(value)), label="key")
        value[key] = data.draw(json_values, label="value")
        path.write_text(json.dumps(value))


# Mutations that leave no file the plan could read: of a file it reads (the config, the
# safetensors index, a shard), each must be refused. Truncating a shard too (its header's sizes
# say so); not a JSON file, which may end in a newline that a truncation only drops.
BREAKING = {"directory", "dangling link", "link loop", "delete"}


def read_by_plan(name: str) -> bool:
    return name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json"))


def run_plan(argv: list[str], capsys, *, must_fail: bool = False) -> None:
    """`offloadctl plan`: exit 0, or 2 with one line that starts with "error: " (and 2 where
    the input cannot be planned from, `must_fail`); no traceback, no process left."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(argv)
    captured = capsys.readouterr()
    event(f"exit {code}")
    assert code in ((2,) if must_fail else (0, 2)), (code, captured.err[-MAX_MESSAGE_CHARS:])
    if code == 2:
        message = captured.err.strip()
        assert message.startswith("error: ") and "Traceback" not in message, message
        assert len(message) <= MAX_MESSAGE_CHARS and message.count("\n") == 0, message
    # nothing left running: plan starts no process of its own
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_mutated_checkpoint_gives_one_line(valid: Path, capsys, data) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(shutil.copytree(valid, Path(tmp) / "ckpt"))
        files = sorted(p.name for p in root.iterdir())
        name = data.draw(st.sampled_from(files), label="file")
        kinds = ["truncate", "overwrite", "directory", "dangling link", "link loop", "delete"]
        if name.endswith(".json"):
            kinds += ["json value", "json document"]
        how = data.draw(st.sampled_from(kinds), label="how")
        mutate_file(root / name, how, data)
        broken = read_by_plan(name) and (
            how in BREAKING or (how == "truncate" and name.endswith(".safetensors"))
        )
        argv = ["plan", "--checkpoint", str(root), "--gpus", "2", "--gpu-memory", "1MiB"]
        run_plan(argv, capsys, must_fail=broken)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_mutated_job_file_gives_one_line(valid: Path, capsys, data) -> None:
    job = json.loads(json.dumps(JOB))
    job["checkpoint"] = str(valid)
    where = data.draw(st.sampled_from(["top", "override", "match", "labels", "env"]), label="at")
    target = {
        "top": job,
        "override": job["overrides"][0],
        "match": job["overrides"][0]["match"],
        "labels": job["overrides"][0]["match"]["labels"],
        "env": job["overrides"][0]["env"],
    }[where]
    key = data.draw(st.sampled_from([*sorted(target), "unknown_key"]), label="key")
    target[key] = data.draw(json_values, label="value")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(job))
        run_plan(["plan", "--config", str(path)], capsys)


def test_a_key_with_a_newline_is_named_on_one_line(valid: Path, capsys, tmp_path) -> None:
    """Found by the test above: an env key "\n" with no value broke the error over two lines."""
    job = json.loads(json.dumps(JOB))
    job["checkpoint"] = str(valid)
    job["overrides"][0]["env"] = {"\n": None}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["plan", "--config", str(path)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0 and "overrides[0].env['\\n']: expected a single value" in (
        message
    ), message


@pytest.mark.parametrize("model_type", [[None], ["llama"], 3, {"llama": 1}])
def test_a_model_type_that_is_not_a_string_is_one_line(
    valid: Path, capsys, tmp_path, model_type
) -> None:
    """Found by the test above: a list reached transformers' config registry (a TypeError)."""
    root = Path(shutil.copytree(valid, tmp_path / "ckpt"))
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    assert main(["plan", "--checkpoint", str(root), "--gpus", "2", "--gpu-memory", "1MiB"]) == 2
    assert "config.json: model_type must be a string" in capsys.readouterr().err


def test_a_checkpoint_path_with_a_newline_is_named_on_one_line(capsys, tmp_path) -> None:
    """Found by the job-file test above: checkpoint "\n" broke "not a directory" over two lines."""
    assert main(["plan", "--checkpoint", "\n", "--gpus", "1", "--gpu-memory", "1MiB"]) == 2
    message = capsys.readouterr().err.strip()
    assert message == "error: '\\n': not a directory", message
