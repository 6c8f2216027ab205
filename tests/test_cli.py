"""offloadctl without Ray: make-checkpoint, plan, node-demo, and errors without tracebacks; and
`run --check` for real on the embedded Ray, in bf16, where it allows rounding."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli import EXIT_ERROR, main

TINY = [
    "--layers",
    "4",
    "--hidden-size",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--intermediate-size",
    "64",
    "--vocab",
    "64",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("cli") / "ckpt"
    assert main(["make-checkpoint", str(out), *TINY]) == 0
    return str(out)


def test_node_demo_reports_decision_bytes_and_timings(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["node-demo", "--layers", "3", "--hidden", "512", "--batch", "2", "--repeats", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "pin decision: pin=" in out and "(source: " in out
    assert "3 layers, 3.0 MiB offloaded" in out  # 3 x (512*512+512) fp32 = 3.0 MiB
    for mode in ("resident", "prefetch", "synchronous"):
        assert f"{mode}:" in out
    assert "outputs identical" in out


def test_plan_text_and_json(checkpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["plan", "--checkpoint", checkpoint, "--gpus", "2", "--gpu-memory", "60KiB"]) == 0
    text = capsys.readouterr().out
    assert "bottleneck" in text and "layers." in text
    assert (
        main(
            [
                "plan",
                "--checkpoint",
                checkpoint,
                "--gpus",
                "2",
                "--gpu-memory",
                "60KiB",
                "--nodes",
                "2",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    covered = [name for stage in plan["stages"] for name in stage["layers"]]
    assert covered == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert all(s["device_bytes"] <= 60 * 1024 for s in plan["stages"])


def test_plan_takes_resident_weights(checkpoint: str, capsys) -> None:
    """`--resident-weights stored` reaches the plan; a bf16 checkpoint has nothing to keep as
    stored, so its stages are as at width."""
    capsys.readouterr()
    argv = ["plan", "--checkpoint", checkpoint, "--gpus", "2", "--gpu-memory", "60KiB", "--json"]
    assert main([*argv, "--resident-weights", "stored"]) == 0
    stored = json.loads(capsys.readouterr().out)
    assert stored["options"]["resident_weights"] == "stored"
    for s in stored["stages"]:
        assert not s["resident_stored"] and not s["jit_bytes"]
        assert s["resident_wide_bytes"] == s["resident_bytes"]


def test_plan_shows_the_measured_link_rate(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import offload.link

    argv = ["plan", "--checkpoint", checkpoint, "--gpus", "2", "--gpu-memory", "60KiB"]
    for name in ("measure_cpu_copy", "measure_host_to_device"):  # CPU or CUDA, whichever runs
        monkeypatch.setattr(offload.link, name, lambda *a, **k: 12.5e9)
    capsys.readouterr()
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "link" in text.splitlines()[1] and "12.5 GB/s" in text
    assert "12.5 GB/s (default)" not in text  # measured; only the compute rate is a default

    def broken(*args, **kwargs) -> float:
        raise MemoryError("no memory for the probe's buffers")

    for name in ("measure_cpu_copy", "measure_host_to_device"):
        monkeypatch.setattr(offload.link, name, broken)
    assert main(argv) == 0
    assert "25.0 GB/s (default)" in capsys.readouterr().out  # PlanOptions' default, marked


def test_plan_does_not_import_ray(checkpoint: str) -> None:
    code = (
        "import sys\n"
        "from coordinator.cli import main\n"
        f"assert main(['plan', '--checkpoint', {checkpoint!r}, '--gpus', '2', "
        "'--gpu-memory', '60KiB']) == 0\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.splitlines()[-1] == "False"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "--checkpoint", "CKPT", "--gpus", "2", "--gpu-memory", "1KiB"],
            "raise --gpu-memory",
        ),
        (["plan", "--checkpoint", "CKPT"], "needs --gpus"),
        (
            ["plan", "--checkpoint", "/nonexistent", "--gpus", "1", "--gpu-memory", "1MiB"],
            "not a directory",
        ),
        (["make-checkpoint", "CKPT"], "not empty"),
        (
            ["make-checkpoint", "NEW", "--heads", "3"],
            "hidden_size=256 must be a multiple of num_heads=3",
        ),
    ],
)
def test_errors_are_one_line_without_traceback(
    checkpoint: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    argv = [a.replace("CKPT", checkpoint).replace("NEW", str(tmp_path / "new")) for a in argv]
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_yaml_typo_is_reported(checkpoint: str, tmp_path: Path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"checkpoint: {checkpoint}\ngpus: 2\ngpu_memroy_bytes: 1MiB\n")
    assert main(["plan", "--config", str(job)]) == EXIT_ERROR
    assert "did you mean 'gpu_memory_bytes'" in capsys.readouterr().err


def test_bad_flag_values_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["node-demo", "--layers", "0"])
    assert info.value.code == 2
    assert "must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--checkpoint", "x", "--gpu-memory", "lots"])
    assert "is not a size" in capsys.readouterr().err
    for argv in (
        ["node-demo", "--step", "65"],
        ["plan", "--checkpoint", "x", "--prefetch-step", "0"],
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert "must be in 1..64, got" in capsys.readouterr().err  # the flag, before any work
    with pytest.raises(SystemExit):
        main(["plan", "--checkpoint", "x", "--batch-wait", "5"])  # seconds, not ms
    assert "must be a number of seconds in 0..1, got 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--checkpoint", "x", "--resident-weights", "fp4"])
    assert "--resident-weights: invalid choice: 'fp4'" in capsys.readouterr().err


def test_run_check_in_float32_allows_no_difference(monkeypatch, capsys, tmp_path) -> None:
    """A float32 job's logits one unit in the last place off the reference's fail the check:
    float32 has no tolerance (2 units of rounding at the logits' scale, bf16's rule, would pass
    this one). The job and the reference are stood in for; the check for real, in bf16:
    `test_run_check_of_a_bf16_job_allows_its_rounding_only`."""
    import contextlib

    import torch

    import coordinator.runtime.launch
    import coordinator.tools.reference

    logits = torch.full((2, 16, 10), 8.0)
    expected = logits.clone()
    expected[1, 5, 3] = torch.nextafter(torch.tensor(8.0), torch.tensor(9.0))

    class FakeJob:
        index = type(
            "Index",
            (),
            {
                "config": {"vocab_size": 10},
                "total_bytes": 0,
                "family": "llama",
                "dtype": "float32",
                "num_decoder_layers": 2,
            },
        )()
        plan = type(
            "Plan",
            (),
            {
                "summary": lambda self: "plan",
                "options": type("Options", (), {"offload_dtype": "auto"})(),
            },
        )()
        load_reports = ()
        workers = ()
        session = type("Session", (), {"owned": True})()

        def forward(self, ids):
            return logits

    monkeypatch.setattr(
        coordinator.runtime.launch,
        "launch",
        lambda config, progress, name: contextlib.nullcontext(FakeJob()),
    )
    monkeypatch.setattr(coordinator.tools.reference, "reference_logits", lambda *a, **k: expected)
    (tmp_path / "config.json").write_text("{}")  # read before loading: no context window
    diff = 8.0 * torch.finfo(torch.float32).eps  # one unit in the last place of 8
    assert main(["run", "--checkpoint", str(tmp_path), "--check"]) == 1
    assert f"check FAILED: max abs difference {diff:.3e}" in capsys.readouterr().out


@pytest.mark.parametrize(("steps", "passes"), [(4, True), (8, False)])
def test_run_check_of_a_bf16_job_allows_its_rounding_only(
    tmp_path, monkeypatch, capsys, steps: int, passes: bool
) -> None:
    """`offloadctl run --check` for real, on the embedded Ray, on a bf16 checkpoint written by
    transformers: the job's logits are those of the files it loaded (bitwise: the digest it
    prints), and its reference, transformers' real one, reads a copy of the checkpoint whose
    final norm has one weight `steps` bf16 steps larger, so the logits differ a little (the
    job's logits are otherwise bitwise transformers': test_named_loads). Within 2 units of
    bf16 rounding at the logits' scale the check passes, naming the difference and the
    tolerance; past it, it fails with exit 1."""
    import hashlib
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    import coordinator.tools.reference

    checkpoint = tmp_path / "ckpt"
    assert main(["make-checkpoint", str(checkpoint), *TINY, "--dtype", "bfloat16"]) == 0
    altered = tmp_path / "altered"
    shutil.copytree(checkpoint, altered)
    weights = load_file(altered / "model.safetensors")
    norm = weights["model.norm.weight"].clone()
    assert norm.dtype == torch.bfloat16 and float(norm[0]) > 0
    # a positive bf16's bits, as an integer, count its steps: `steps` representable values up
    norm[:1] = (norm[:1].view(torch.int16) + steps).view(torch.bfloat16)
    weights["model.norm.weight"] = norm
    save_file(weights, altered / "model.safetensors", metadata={"format": "pt"})

    real_reference = coordinator.tools.reference.reference_logits
    seen = {}

    def reference_of_the_altered_copy(path, ids, **kwargs):
        assert Path(path) == checkpoint and kwargs["dtype"] == "bfloat16"
        seen["files"] = real_reference(path, ids, **kwargs)  # what the job loaded
        seen["altered"] = real_reference(str(altered), ids, **kwargs)
        return seen["altered"]

    monkeypatch.setattr(
        coordinator.tools.reference, "reference_logits", reference_of_the_altered_copy
    )
    argv = ["run", "--checkpoint", str(checkpoint), "--gpus", "1", "--gpu-memory", "1MiB"]
    code = main([*argv, "--check"])
    out = capsys.readouterr().out
    assert "model: llama, bfloat16, 4 blocks" in out
    files, expected = seen["files"], seen["altered"]
    digest = hashlib.sha256(files.contiguous().view(torch.uint8).numpy()).hexdigest()[:16]
    assert f"bfloat16: sum {float(files.double().sum()):.6f}, sha256 {digest};" in out
    diff = float((files.float() - expected.float()).abs().max())
    tolerance = 2 * torch.finfo(torch.bfloat16).eps * float(expected.float().abs().max())
    where = "transformers in one process (bfloat16)"
    if passes:
        assert 0 < diff <= tolerance  # the case: not bitwise, within rounding
        assert code == 0, out
        assert (
            f"check: logits within bfloat16 rounding of {where} "
            f"(max abs difference {diff:.3e} <= {tolerance:.3e})"
        ) in out
    else:
        assert diff > tolerance  # the case: past rounding
        assert code == 1, out
        assert f"check FAILED: max abs difference {diff:.3e} from {where}" in out


def test_an_address_where_nothing_listens_fails_at_once(capsys) -> None:
    """Ray itself retries such an address for minutes; we give one line naming it."""
    import socket
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert main(["list", "--address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port}" in err and "Traceback" not in err


def test_ray_address_with_gpus_is_refused(monkeypatch, capsys, tmp_path) -> None:
    """--address with --gpus is refused by the job config; RAY_ADDRESS with --gpus too, rather
    than --gpus being dropped silently."""
    from coordinator.config import JobConfig
    from coordinator.runtime.session import ConfigError, connect

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"gpus=3 creates logical GPUs .* RAY_ADDRESS="):
        connect(JobConfig(checkpoint=str(tmp_path), gpus=3))


def test_serving_off_loopback_needs_an_api_key(monkeypatch, capsys, tmp_path) -> None:
    """Refused at start, before anything is loaded: anyone who reaches the port would use the
    GPUs."""
    monkeypatch.delenv("OFFLOAD_API_KEY", raising=False)
    assert main(["serve", "--checkpoint", str(tmp_path), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "serving on 0.0.0.0 without an API key" in err and "OFFLOAD_API_KEY" in err
    empty = tmp_path / "key"
    empty.write_text("\n")
    assert main(["serve", "--checkpoint", str(tmp_path), "--api-key-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_an_empty_stop_text_is_refused_before_loading(capsys, tmp_path) -> None:
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path),
                "--prompt",
                "hi",
                "--stop",
                "a",
                "--stop",
                "",
            ]
        )
        == 2
    )
    assert "--stop needs a non-empty text" in capsys.readouterr().err


def test_plan_reserves_the_kv_cache_asked_for(checkpoint: str, capsys) -> None:
    """--max-batch / --max-seq-len reach the planner (they were dropped by `plan`, which then
    showed no KV cache), and a window past the model's context is refused."""
    argv = ["plan", "--checkpoint", checkpoint, "--gpus", "2", "--gpu-memory", "200KiB"]
    capsys.readouterr()
    assert main([*argv, "--max-batch", "2", "--max-seq-len", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # llama: 2 (keys, values) x 2 KV heads x head dim 8 x 4 bytes (fp32), per token and layer
    assert sum(s["kv_bytes"] for s in plan["stages"]) == 4 * 2 * 64 * 2 * 2 * 8 * 4
    assert main([*argv, "--max-batch", "2", "--max-seq-len", "64"]) == 0
    assert (
        "KV pool of 128 tokens per GPU (32.00 KiB), for up to 2 sequences of up to 64 tokens: it "
        "holds 8 of the expected 16 tokens, 2 of max_seq_len"
    ) in capsys.readouterr().out
    assert main([*argv, "--max-batch", "8", "--max-seq-len", "64", "--kv-cache-tokens", "200"]) == 0
    assert "KV pool of 208 tokens per GPU" in capsys.readouterr().out  # whole blocks
    assert main([*argv, "--max-seq-len", "64", "--kv-cache-tokens", "50"]) == EXIT_ERROR
    assert "kv_cache_tokens=50 cannot hold one sequence of max_seq_len=64" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--max-seq-len", "4096"]) == EXIT_ERROR
    assert (
        "error: max_seq_len=4096 exceeds the model's context of 2048 tokens "
        "(max_position_embeddings in config.json)"
    ) in capsys.readouterr().err


def test_a_prompt_past_the_context_is_refused_before_loading(tmp_path, capsys) -> None:
    import ray

    short = tmp_path / "short"
    assert main(["make-checkpoint", str(short), *TINY, "--max-positions", "16"]) == 0
    capsys.readouterr()
    argv = [
        "generate",
        "--checkpoint",
        str(short),
        "--gpu-memory",
        "1MiB",
        "--prompt",
        "the workers keep their own layers " * 4,
        "--max-new-tokens",
        "8",
    ]
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert (
        "exceed the model's context of 16 tokens (max_position_embeddings in config.json): "
        "shorten the prompt or lower max_new_tokens" in err
    ), err
    assert not ray.is_initialized()


class LaunchCalled(BaseException):
    """Raised by a stand-in for `launch`: the command got as far as loading, with `config`. A
    BaseException, so it passes through the CLI's report of unexpected exceptions as bugs."""

    def __init__(self, config) -> None:
        super().__init__("launch called")
        self.config = config


@pytest.fixture
def no_launch(monkeypatch):
    """`launch` replaced: commands are checked up to the point where they would load."""
    import coordinator.runtime.launch as job_module

    def launch(config, *_, **__):
        raise LaunchCalled(config)

    monkeypatch.setattr(job_module, "launch", launch)
    monkeypatch.setattr(job_module, "launch_replicas", launch)


def test_serve_defaults_fill_only_what_is_not_given(checkpoint, tmp_path, no_launch) -> None:
    """serve plans sequences of 512 tokens (or the model's window) for throughput: the batch
    and the replicas are the plan's to choose (0: auto), unless the flags or the job file say
    otherwise; an explicit --max-batch is kept as given. For latency, no replicas."""

    def planned(*extra: str) -> tuple[int, int]:
        with pytest.raises(LaunchCalled) as called:
            main(
                ["serve", "--checkpoint", checkpoint, "--gpus", "1", "--gpu-memory", "8MiB", *extra]
            )
        return called.value.config.max_batch, called.value.config.max_seq_len

    assert planned() == (0, 512)
    with pytest.raises(LaunchCalled) as called:
        main(["serve", "--checkpoint", checkpoint, "--gpus", "1", "--gpu-memory", "8MiB"])
    assert (called.value.config.objective, called.value.config.replicas) == ("throughput", 0)
    with pytest.raises(LaunchCalled) as called:
        main(
            [
                "serve",
                "--checkpoint",
                checkpoint,
                "--gpus",
                "1",
                "--gpu-memory",
                "8MiB",
                "--objective",
                "latency",
            ]
        )
    assert (called.value.config.objective, called.value.config.replicas) == ("latency", 1)
    assert planned("--max-batch", "2") == (2, 512)
    assert planned("--max-batch", "auto") == (0, 512)
    assert planned("--max-seq-len", "256") == (0, 256)
    job = tmp_path / "job.yaml"
    job.write_text(f"checkpoint: {checkpoint}\nmax_batch: 3\n")
    assert planned("--config", str(job)) == (3, 512)
    assert planned("--config", str(job), "--max-batch", "1") == (1, 512)
    short = tmp_path / "short"
    assert main(["make-checkpoint", str(short), *TINY, "--max-positions", "100"]) == 0
    with pytest.raises(LaunchCalled) as called:
        main(["serve", "--checkpoint", str(short), "--gpus", "1", "--gpu-memory", "8MiB"])
    assert called.value.config.max_seq_len == 100  # the model's window, when under 512


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "mine", "--gpus", "2"],
        ["run", "mine", "--checkpoint", "x", "--max-batch", "2"],
        ["generate", "mine", "--prompt", "hi", "--gpu-memory", "1MiB"],
        ["serve", "mine", "--config", "job.yaml"],
    ],
)
def test_a_named_load_refuses_flags_that_describe_loading(argv, capsys) -> None:
    import ray

    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "set how a model is loaded, but 'mine' is a load that exists" in err, err
    assert not ray.is_initialized()  # said before connecting to anything


def test_generate_settles_its_settings_before_loading(checkpoint, capsys, no_launch) -> None:
    base = [
        "generate",
        "--checkpoint",
        checkpoint,
        "--gpus",
        "1",
        "--gpu-memory",
        "8MiB",
        "--prompt",
        "the workers keep their own layers",
    ]
    assert main([*base, "--temperature", "-1"]) == EXIT_ERROR
    assert "temperature=-1.0 must be >= 0" in capsys.readouterr().err
    assert main([*base, "--max-seq-len", "8", "--max-new-tokens", "20"]) == EXIT_ERROR
    assert "more than --max-seq-len 8: raise it, or leave it out" in capsys.readouterr().err
    with pytest.raises(LaunchCalled) as called:  # left out: planned for the request
        main([*base, "--max-new-tokens", "20"])
    assert called.value.config.max_seq_len > 20


def test_top_p_or_top_k_without_a_temperature_samples() -> None:
    from coordinator.engine.generation import sampling_options

    assert sampling_options(None, 0.3, None, None)["do_sample"] is True
    assert sampling_options(None, None, 5, 7)["do_sample"] is True
    assert "do_sample" not in sampling_options(None, 1.0, None, 7)  # top_p 1: no knob turned
    assert sampling_options(0, 0.3, None, None)["do_sample"] is False  # temperature 0: greedy


def test_run_checks_its_input_before_loading(tmp_path, capsys) -> None:
    import ray

    short = tmp_path / "short"
    assert main(["make-checkpoint", str(short), *TINY, "--max-positions", "16"]) == 0
    base = ["run", "--checkpoint", str(short), "--gpus", "1", "--gpu-memory", "8MiB"]
    capsys.readouterr()
    assert main([*base, "--seq-len", "32"]) == EXIT_ERROR
    assert (
        "32 input tokens exceed the model's context of 16 tokens (max_position_embeddings "
        "in config.json): lower --seq-len"
    ) in capsys.readouterr().err
    assert main([*base, "--input-ids", "1,2,3", "--seq-len", "3", "--seed", "1"]) == EXIT_ERROR
    assert (
        "--input-ids gives the tokens; --seq-len, --seed shape random input only"
        in capsys.readouterr().err
    )
    assert main([*base, "--input-ids", "1,two"]) == EXIT_ERROR
    assert "expected comma-separated token ids" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_plan_applies_the_job_files_overrides(checkpoint, tmp_path, capsys) -> None:
    """As `run` does: an override forcing pinned memory where there is nothing to pin for is
    refused by `plan` too, and the message says the job's override set it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("pinning is possible with CUDA")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"checkpoint: {checkpoint}\ngpus: 1\ngpu_memory_bytes: 8MiB\noverrides:\n"
        "  - match: {hostname: '*'}\n    env: {OFFLOAD_PIN_MEMORY: 'on'}\n"
    )
    capsys.readouterr()
    assert main(["plan", "--config", str(job)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "forces pinned host memory" in err
    assert "(OFFLOAD_PIN_MEMORY is set by the job override for this node: change it there)" in err
    job.write_text(job.read_text().replace("'on'", "'off'"))
    assert main(["plan", "--config", str(job)]) == 0


def test_make_checkpoint_ignores_expert_flags_outside_moe(tmp_path) -> None:
    assert main(["make-checkpoint", str(tmp_path / "c"), *TINY, "--experts", "1"]) == 0
    assert (
        main(["make-checkpoint", str(tmp_path / "m"), *TINY, "--arch", "mixtral", "--experts", "1"])
        == EXIT_ERROR
    )


def test_an_exception_that_is_not_ours_is_a_bug_with_its_traceback(
    checkpoint, monkeypatch, capsys
) -> None:
    """Only our error kinds (and OSError) are one-line user errors; a stray ValueError from a
    library is reported as a bug: traceback, exit 1, never dressed up as the user's mistake."""
    import coordinator.cli as cli

    def broken(*_args, **_kwargs):
        raise ValueError("something inside a library")

    monkeypatch.setattr("coordinator.planning.planner.plan", broken)
    code = cli.main(["plan", "--checkpoint", checkpoint, "--gpus", "1", "--gpu-memory", "8MiB"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_BUG == 1
    assert "Traceback" in err and "ValueError: something inside a library" in err
    assert "internal error (a bug" in err and "error: something" not in err


def test_plan_shows_the_batch_it_sizes_from_memory(checkpoint, capsys) -> None:
    """--max-batch auto: plan says how many sequences the KV pool beside the weights holds at
    the expected length, and planning with that many gives the same placement and pool; without
    --max-seq-len there is nothing to size by."""
    args = ["plan", "--checkpoint", checkpoint, "--gpus", "1", "--gpu-memory", "8MiB"]
    assert main([*args, "--max-seq-len", "64", "--max-batch", "auto"]) == 0
    out = capsys.readouterr().out
    batch = int(
        re.search(r"max_batch (\d+), micro-batches auto: the sequences the KV pool", out).group(1)
    )
    assert 1 <= batch <= 64
    placed = []
    for given in ("auto", str(batch)):  # the same placement and KV cache either way
        assert main([*args, "--max-seq-len", "64", "--max-batch", given, "--json"]) == 0
        stages = json.loads(capsys.readouterr().out)["stages"]
        placed.append([(s["layers"], s["offloaded"], s["kv_bytes"]) for s in stages])
    assert placed[0] == placed[1]
    assert main([*args, "--max-batch", "auto"]) == EXIT_ERROR
    assert "needs max_seq_len" in capsys.readouterr().err


def test_plan_for_throughput_chooses_the_batch_and_draws_the_curve(
    checkpoint, capsys, tmp_path
) -> None:
    """--objective throughput: the plan names its batch, micro-batches and predicted tokens/s,
    the best of the curve it prints over batch sizes, which --plot draws; the JSON plan is the
    same plan. A latency bound no plan meets is an error naming the shortest time there is."""
    args = [
        "plan",
        "--checkpoint",
        checkpoint,
        "--gpus",
        "2",
        "--gpu-memory",
        "8MiB",
        "--max-seq-len",
        "64",
        "--objective",
        "throughput",
        "--replicas",
        "1",
    ]
    png = tmp_path / "curve.png"
    assert main([*args, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    chosen = re.search(r"max_batch (\d+), micro-batches (\d+): chosen for the most decode", out)
    predicted = float(re.search(r"objective throughput: ([\d.]+) decode tokens/s", out).group(1))
    curve = {int(b): float(r) for b, r in re.findall(r"(\d+): ([\d.]+) \(k=\d+\)", out)}
    assert curve[int(chosen.group(1))] == predicted == max(curve.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert (options["max_batch"], options["micro_batches"]) == tuple(map(int, chosen.groups()))
    assert main([*args, "--max-token-latency", "0.000001"]) == EXIT_ERROR
    assert "no plan meets --max-token-latency" in capsys.readouterr().err
    # two pipelines of one GPU each, each with its own plan on its own GPU
    assert main([*args[:-1], "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 replicas of 1 stage(s): ") and "replica 1:" in out
    total = float(re.search(r"([\d.]+) decode tokens/s predicted in all", out).group(1))
    each = [float(t) for t in re.findall(r"objective throughput: ([\d.]+) decode", out)]
    assert len(each) == 2 and total == pytest.approx(sum(each), abs=0.11)
    assert main([*args[:-1], "2", "--json"]) == 0
    replicas = json.loads(capsys.readouterr().out)
    assert [[s["gpu_index"] for s in r["stages"]] for r in replicas] == [[0], [1]]
    assert main([*args[:-1], "auto", "--objective", "latency"]) == EXIT_ERROR
    assert "replicas serve for throughput" in capsys.readouterr().err
