"""`offloadctl serve` as users run it: a real server process on an embedded Ray, called with the
official `openai` client. Completions (plain, streamed, chat) equal transformers' greedy
`generate` decoded with the same tokenizer; a wrong key is 401, bad requests 400 with a
message; a client that leaves mid-stream frees what its request held; SIGTERM stops it all,
its embedded Ray included."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from helpers import names_of, ray_session_processes, session_dir_of, still_running
from ray_head import free_ports

from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from coordinator.tools.reference import reference_generate

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
OFFLOADCTL = str(Path(sys.executable).with_name("offloadctl"))


def greedy_text(checkpoint: str, tokenizer, ids, max_new_tokens: int) -> str:
    out = reference_generate(
        checkpoint, ids, num_threads=1, max_new_tokens=max_new_tokens, do_sample=False
    )
    new = out[0, ids.shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True)


def post(url: str, body: bytes, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@dataclass
class Served:
    base: str  # the API's base URL
    key: str
    checkpoint: str
    proc: subprocess.Popen
    log_path: Path
    spawned: list[psutil.Process]  # the processes the command had started once it served
    session: str  # its embedded Ray's session directory ("" on a cluster it joined)
    # its engine's token gate (coordinator.engine.engine.HOLD_TOKENS_ENV), open while the file
    # exists; None: not gated
    gate: Path | None = None

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]

    def errors(self, limit: int = 6000) -> str:
        """The error lines and tracebacks of its log and of its embedded Ray's Serve and worker
        logs (a replica's own log says what a route raised): what a failed test shows."""
        logs = [self.log_path]
        if self.session:
            logs += sorted(Path(self.session, "logs").glob("serve/replica_*.log"))
            logs += sorted(Path(self.session, "logs").glob("worker-*.err"))
        found = []
        for path in logs:
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()
                starts = [i for i, line in enumerate(lines) if re.search(r"ERROR|Traceback", line)]
                shown = 0
                for i in starts:  # the record and what follows it (its traceback), once
                    if i >= shown:
                        found.append(f"{path.name}: " + "\n".join(lines[i : i + 30]))
                        shown = i + 30
        return "\n".join(found)[-limit:] or "(no error in the server's logs)"


def tiny_checkpoint(root: Path) -> str:
    """The tiny llama checkpoint these tests serve, written under `root`."""
    return str(
        make_checkpoint(
            root / "tiny-llama",
            CheckpointShape(
                num_layers=4,
                hidden_size=64,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=128,
                vocab_size=512,
                max_positions=256,
            ),
        )
    )


@contextlib.contextmanager
def serving(
    root: Path,
    *flags: str,
    load: str | None = None,
    checkpoint: str | None = None,
    ray_env: dict[str, str] | None = None,
    extra_env: dict[str, str] | None = None,
):
    """`offloadctl serve` with these flags: of the named `load`, or of `checkpoint` (default:
    the tiny checkpoint written under `root`); on its own embedded Ray, or on the cluster that
    `ray_env` joins (RAY_ADDRESS and its token); `extra_env`: more variables for it (its embedded
    Ray's processes inherit them). Stopped on leaving (SIGTERM, then its whole
    process group killed), so nothing outlives the caller."""
    if load is None:
        checkpoint = checkpoint or tiny_checkpoint(root)
    port, key = free_ports(1)[0], secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(ray_env or {})
    env.update(extra_env or {})
    env["OFFLOAD_API_KEY"] = key
    log_path = root / f"serve-{port}.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed in finally
    what = [load] if load is not None else ["--checkpoint", checkpoint]
    proc = subprocess.Popen(
        [OFFLOADCTL, "serve", *what, "--port", str(port), *flags],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
            try:
                request = urllib.request.Request(
                    f"{base}/models", headers={"Authorization": f"Bearer {key}"}
                )
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"not up: {log_path.read_text()[-3000:]}"
            time.sleep(1)
        spawned = psutil.Process(proc.pid).children(recursive=True)
        session = session_dir_of(spawned) if ray_env is None else ""
        yield Served(base, key, checkpoint or "", proc, log_path, spawned, session)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # only this test's own process group
                proc.wait(timeout=STOP_TIMEOUT_S)
        log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One GPU, so one stage: its worker runs several decode steps per call when no request
    waits (stop strings and clients that leave end their request at the next step boundary).
    Its engine's token gate is open (its file exists) but for the test that closes it. The
    module's last test stops it; if a test fails before, it is stopped here."""
    from coordinator.engine.engine import HOLD_TOKENS_ENV

    root = tmp_path_factory.mktemp("serve")
    gate = root / "tokens-open"
    gate.touch()
    with serving(
        root,
        "--gpus",
        "1",
        "--gpu-memory",
        "8MiB",
        "--max-seq-len",
        "64",
        "--max-batch",
        "2",
        extra_env={HOLD_TOKENS_ENV: str(gate)},
    ) as server:
        server.gate = gate
        yield server


@pytest.fixture(scope="module")
def server(served) -> tuple[str, str, str]:
    """(base url, key, checkpoint dir) of the served checkpoint."""
    return served.base, served.key, served.checkpoint


def test_openai_client_gets_transformers_greedy_text(server) -> None:
    import openai
    from transformers import AutoTokenizer

    base, key, checkpoint = server
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert [(m.id, m.max_model_len) for m in client.models.list()] == [("tiny-llama", 64)]

    prompt = "the quick brown fox"
    expected = greedy_text(
        checkpoint, tokenizer, tokenizer(prompt, return_tensors="pt")["input_ids"], 12
    )
    done = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0
    )
    assert done.choices[0].text == expected
    assert done.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    streamed = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected

    # A stop string inside the greedy text: the text ends where it begins, finish_reason stop,
    # streamed alike (with the usage chunk stream_options asks for).
    assert len(expected) >= 5
    stop = expected[2:5]
    before = expected[: expected.find(stop)]
    cut = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop, "never in it \u2603"],
    )
    assert cut.choices[0].text == before and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 12
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == before
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == cut.usage.completion_tokens
    )

    messages = [{"role": "user", "content": "hello there"}]
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    chat = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content == greedy_text(checkpoint, tokenizer, chat_ids, 8)
    deltas = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in deltas if c.choices)
    assert text == chat.choices[0].message.content


def test_wrong_key_and_bad_requests_get_4xx(server) -> None:
    import openai

    base, key, _ = server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    with pytest.raises(
        openai.BadRequestError, match="exceed the KV cache reserved for max_seq_len=64"
    ):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=200)
    with pytest.raises(
        openai.BadRequestError,
        match=r"exceed the model's context of 256 tokens "
        r"\(max_position_embeddings in config.json\)",
    ):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=300)
    with pytest.raises(openai.BadRequestError, match=r"exceed the model's context"):  # streamed:
        client.completions.create(
            model="tiny-llama",
            prompt="hi",
            max_tokens=300,  # 400 first
            stream=True,
        )
    with pytest.raises(
        openai.BadRequestError,
        match=r"exceed the KV cache reserved for "
        r"max_seq_len=64",
    ):
        client.chat.completions.create(
            model="tiny-llama",
            max_tokens=100,
            stream=True,
            messages=[{"role": "user", "content": "hi"}],
        )
    # the field at fault named, as the API calls it
    for path, body, field in (
        ("completions", {"prompt": "hi", "max_tokens": 200}, "max_tokens"),
        ("completions", {"prompt": "hi", "max_tokens": 4, "n": 3}, "n"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300},
            "max_completion_tokens",
        ),
    ):
        status, answer = post(f"{base}/{path}", json.dumps(body).encode(), key)
        assert status == 400 and answer["error"]["param"] == field, answer
    assert post(f"{base}/completions", b"not json", key)[0] == 400
    with pytest.raises(
        openai.NotFoundError,
        match=r"the model 'other' does not exist here: this "
        r"server serves 'tiny-llama'",
    ):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    status, body = post(f"{base}/completions", json.dumps({"prompt": 3}).encode(), key)
    assert status == 400 and "'prompt' must be a non-empty string" in body["error"]["message"]
    status, body = post(f"{base}/chat/completions", json.dumps({"messages": "hi"}).encode(), key)
    assert status == 400 and "'messages' must be a non-empty list" in body["error"]["message"]
    # settings the server does not apply are refused, not ignored
    status, body = post(
        f"{base}/completions", json.dumps({"prompt": "hi", "suffix": "then"}).encode(), key
    )
    assert status == 400 and "'suffix'='then' is not supported" in body["error"]["message"]
    status, body = post(
        f"{base}/completions", json.dumps({"prompt": "hi", "stop": ["a", ""]}).encode(), key
    )
    assert status == 400 and "'stop' must be a non-empty string" in body["error"]["message"]
    assert (
        post(f"{base}/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(), key)[0]
        == 200
    )  # the server is fine after all that


def test_a_clients_bad_temperature_never_fails_the_request_beside_it(server) -> None:
    """Issue 53's two concurrent requests: an innocent greedy one beside one with
    `"temperature": Infinity` (a JSON literal Python's parser takes) or 1e-300. The innocent
    one gets transformers' greedy text; Infinity is a 400 naming `temperature`; 1e-300 is
    greedy, as vLLM treats a temperature below 1e-5."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    base, key, checkpoint = server
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "the workers keep their own layers"
    expected = greedy_text(
        checkpoint, tokenizer, tokenizer(prompt, return_tensors="pt").input_ids, 8
    )
    innocent = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    bodies = [
        innocent,
        f'{{"prompt": "{prompt}", "max_tokens": 8, "temperature": Infinity}}'.encode(),
        innocent,
        f'{{"prompt": "{prompt}", "max_tokens": 8, "temperature": 1e-300, "seed": 1}}'.encode(),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(f"{base}/completions", b, key), bodies))
    (s0, a0), (s1, a1), (s2, a2), (s3, a3) = answers
    assert (s0, s2, s3) == (200, 200, 200), answers
    assert a0["choices"][0]["text"] == a2["choices"][0]["text"] == expected
    assert a3["choices"][0]["text"] == expected
    assert s1 == 400 and a1["error"]["param"] == "temperature", a1
    assert "finite" in a1["error"]["message"]


def test_every_request_field_is_applied_or_refused_by_name() -> None:
    """The table of request fields (OpenAI's schemas, vLLM's extensions): each is applied, of
    no effect on the output, or refused unless "off"; an unknown one is refused naming it."""
    from coordinator.serving.app import (
        APPLIED,
        CHAT,
        COMPLETIONS,
        FIELDS,
        NO_EFFECT,
        BadRequest,
        check_fields,
    )

    applied = {n for n, (_, how) in FIELDS.items() if how == APPLIED}
    assert applied == {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "bad_words",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "echo",
        "skip_special_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "min_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "structured_outputs",
    }
    assert {n for n, (_, how) in FIELDS.items() if how == NO_EFFECT} == {
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "metadata",
        "parallel_tool_calls",
    }
    for name in (
        "spaces_between_special_tokens",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "guided_grammar",
        "allowed_token_ids",
    ):
        assert isinstance(FIELDS[name][1], tuple), name
    for name, (endpoints, how) in FIELDS.items():
        for endpoint in (COMPLETIONS, CHAT):
            if endpoint not in endpoints:
                with pytest.raises(BadRequest, match=f"unknown field '{name}'") as caught:
                    check_fields({name: 1}, endpoint)
                assert caught.value.param == name
            elif isinstance(how, tuple):
                check_fields({name: None}, endpoint)  # null: left out
                for off in how:
                    check_fields({name: off}, endpoint)
                with pytest.raises(BadRequest, match=f"'{name}'=.* is not supported") as caught:
                    check_fields({name: "surely-not-off"}, endpoint)
                assert caught.value.param == name
            else:
                check_fields({name: "any"}, endpoint)  # applied: its own checks come later
    with pytest.raises(BadRequest, match="unknown field 'temprature'"):
        check_fields({"temprature": 0}, COMPLETIONS)
    # the serving page's table of request fields names every one, and no other
    page = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    table = page[page.index("| Field | Endpoints |") :].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", "\n".join(r.split("|")[1] for r in table.splitlines())))
    assert named == set(FIELDS), (set(FIELDS) - named, named - set(FIELDS))


def test_health_version_content_parts_vllm_fields_and_error_shape(server) -> None:
    """/health and /version (no key); chat content as text parts, other parts and tools
    refused by name; vLLM's ignore_eos, stop_token_ids, include_stop_str_in_output and
    continuous_usage_stats applied; errors in OpenAI's shape with the field as `param`."""
    import openai
    from transformers import AutoTokenizer

    base, key, checkpoint = server
    root = base.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=30) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{root}/version", timeout=30) as response:
        assert json.loads(response.read())["version"]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    plain = [{"role": "user", "content": "hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    one = client.chat.completions.create(
        model="tiny-llama", messages=plain, max_tokens=6, temperature=0
    )
    two = client.chat.completions.create(
        model="tiny-llama", messages=parts, max_tokens=6, temperature=0
    )
    assert one.choices[0].message.content == two.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(openai.BadRequestError, match="content part type 'image_url'") as caught:
        client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": [image]}],
            max_tokens=2,
        )
    assert caught.value.body["param"] == "messages[0].content"
    for name, value in (
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "auto"),
        ("store", True),
    ):
        with pytest.raises(openai.BadRequestError, match=f"'{name}'=") as caught:
            client.chat.completions.create(
                model="tiny-llama", messages=plain, max_tokens=2, **{name: value}
            )
        assert caught.value.body["param"] == name and caught.value.body["code"] == 400
    status, body = post(
        f"{base}/completions", json.dumps({"prompt": "hi", "allowed_token_ids": [3]}).encode(), key
    )
    assert status == 400 and body["error"]["param"] == "allowed_token_ids"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post(
        f"{base}/completions", json.dumps({"prompt": "hi", "temprature": 0}).encode(), key
    )
    assert status == 400 and body["error"]["param"] == "temprature"

    # ignore_eos: exactly max_tokens tokens; stop_token_ids: ends at the first such token
    prompt = "the quick brown fox"
    full = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    new = reference_generate(
        checkpoint, prompt_ids, num_threads=1, max_new_tokens=6, do_sample=False
    )[0, prompt_ids.shape[1] :].tolist()
    stop_at = next(
        i
        for i in range(1, 6)
        if new[i] not in new[:i] and tokenizer.eos_token_id not in new[: i + 1]
    )
    stop_id = new[stop_at]  # a token greedy generates, first there, before any end token
    cut = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == tokenizer.decode(new[:stop_at], skip_special_tokens=True)
    kept = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "stop_token_ids": [stop_id],
            "include_stop_str_in_output": True,
        },
    )
    assert kept.choices[0].text.startswith(cut.choices[0].text)
    assert len(kept.choices[0].text) > len(cut.choices[0].text)
    # min_tokens: the stop token cannot come before it; the rest as transformers' generate
    # with min_new_tokens (its logits processor masks it)
    held = reference_generate(
        checkpoint,
        prompt_ids,
        num_threads=1,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=stop_id,
        pad_token_id=0,
        min_new_tokens=stop_at + 2,
    )[0, prompt_ids.shape[1] :].tolist()
    held = held[: held.index(stop_id) + 1] if stop_id in held else held
    late = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": stop_at + 2},
    )
    assert late.usage.completion_tokens == len(held) > stop_at + 2
    assert late.choices[0].text == tokenizer.decode(
        [t for t in held if t != stop_id], skip_special_tokens=True
    )
    with pytest.raises(openai.BadRequestError, match="'min_tokens'=13 must be <= 'max_tokens'=12"):
        client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=12, extra_body={"min_tokens": 13}
        )
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []


def test_tokenize_and_detokenize_as_vllm_answers_them(server) -> None:
    """/tokenize and /detokenize in vLLM's shapes: a prompt's ids as the checkpoint's
    tokenizer gives them (special tokens or not, their strings on request), chat messages'
    through its template, max_model_len; ids back to their text; bad fields and ids 400s
    naming them, a wrong key 401."""
    from transformers import AutoTokenizer

    base, key, checkpoint = server
    root = base.removesuffix("/v1")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "the quick brown fox"

    def call(path: str, body: dict, with_key: str = key) -> tuple[int, dict]:
        return post(f"{root}/{path}", json.dumps(body).encode(), with_key)

    status, answer = call("tokenize", {"model": "tiny-llama", "prompt": prompt})
    ids = tokenizer(prompt)["input_ids"]
    assert status == 200
    assert answer == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    plain = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    status, answer = call(
        "tokenize", {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}
    )
    assert answer["tokens"] == plain  # (this tokenizer adds none: the same ids)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(plain)
    messages = [{"role": "user", "content": "hello there"}]
    status, answer = call("tokenize", {"messages": messages})
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert status == 200 and answer["tokens"] == list(expected)
    status, answer = call("detokenize", {"model": "tiny-llama", "tokens": ids})
    assert status == 200 and answer == {"prompt": tokenizer.decode(ids)}
    for path, body, param in (
        ("tokenize", {"prompt": 3}, "prompt"),
        ("tokenize", {"prompt": prompt, "add_special_token": True}, "add_special_token"),
        ("detokenize", {"tokens": [-1]}, "tokens"),
        ("detokenize", {"tokens": "12"}, "tokens"),
        ("detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ):
        status, answer = call(path, body)
        assert status == 400 and answer["error"]["param"] == param, (path, body, answer)
    assert call("tokenize", {"prompt": prompt}, "wrong")[0] == 401
    assert call("detokenize", {"tokens": ids}, "wrong")[0] == 401
    # /metrics is open (no --metrics-key-file), as vLLM's
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        assert response.status == 200 and "vllm:num_requests_running" in response.read().decode()


def test_metrics_ask_for_their_own_key_when_given_one(tmp_path, monkeypatch) -> None:
    """The API key guards the API, the metrics key (if any) /metrics: each request is checked
    against the key its endpoint asks for; the keys come from their files or environment
    variables, an empty file refused naming its flag."""
    from types import SimpleNamespace

    from coordinator.cli.text import _api_key
    from coordinator.config import ConfigError
    from coordinator.serving.app import OpenAIServer

    server = object.__new__(OpenAIServer.func_or_class)
    server.api_key, server.metrics_key = "api", "scrape"

    def request(key: str | None):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return SimpleNamespace(headers=headers)

    assert server._authorized(request("api")) and not server._authorized(request("scrape"))
    assert server._authorized(request("scrape"), server.metrics_key)
    assert not server._authorized(request("api"), server.metrics_key)
    assert not server._authorized(request(None), server.metrics_key)
    assert server._authorized(request(None), None)  # no metrics key: open
    key_file = tmp_path / "metrics.key"
    key_file.write_text("scrape\n")
    assert _api_key(str(key_file), "--metrics-key-file", "OFFLOAD_METRICS_KEY") == "scrape"
    monkeypatch.setenv("OFFLOAD_METRICS_KEY", "from-env")
    assert _api_key(None, "--metrics-key-file", "OFFLOAD_METRICS_KEY") == "from-env"
    key_file.write_text("")
    with pytest.raises(ConfigError, match=r"--metrics-key-file .* is empty"):
        _api_key(str(key_file), "--metrics-key-file", "OFFLOAD_METRICS_KEY")


def reference_logprobs(checkpoint: str, ids: list[int]):
    """transformers' log_softmax of its float32 logits over `ids` (positions, vocab)."""
    import torch

    from coordinator.tools.reference import reference_logits

    logits = reference_logits(checkpoint, torch.tensor([ids]), num_threads=1)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def greedy_ids(checkpoint: str, ids: list[int], new: int) -> list[int]:
    """transformers' greedy `new` tokens after `ids`, no end token."""
    import torch

    out = reference_generate(
        checkpoint,
        torch.tensor([ids]),
        num_threads=1,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(ids) :].tolist()


def test_guided_decoding_as_vllm_serves_it(server) -> None:
    """response_format json_schema and json_object, guided_choice and guided_regex: the text
    parses as the schema asks or matches; a regex that cannot be used, or two guides, are 400s
    naming the field. Sampled (vLLM's default temperature), several seeds."""
    import openai

    base, key, _ = server
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    shaped = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    for seed in range(3):
        done = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "the weather?"}],
            response_format=shaped,
            max_tokens=40,
            seed=seed,
        )
        parsed = json.loads(done.choices[0].message.content)
        assert set(parsed) == {"city", "sunny"} and isinstance(parsed["sunny"], bool)
        assert done.choices[0].finish_reason == "stop"
    choices = ["north", "south", "east or west"]
    picked = client.completions.create(
        model="tiny-llama",
        prompt="the wind blew from the",
        max_tokens=10,
        seed=4,
        n=2,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text in choices for c in picked.choices), picked.choices
    matched = client.completions.create(
        model="tiny-llama",
        prompt="the boats",
        max_tokens=12,
        extra_body={"guided_regex": "(went|came) (out|back)[.!]"},
    )
    assert re.fullmatch("(went|came) (out|back)[.!]", matched.choices[0].text)
    for extra, field in (
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ):
        status, body = post(
            f"{base}/completions",
            json.dumps({"prompt": "hi", "max_tokens": 4, **extra}).encode(),
            key,
        )
        assert status == 400 and body["error"]["param"] == field, body


class OutputPenalties:
    """vLLM's frequency and presence penalties as a transformers logits processor (generate
    has none of its own), written from vLLM's documented rule: a token's logit loses the
    frequency penalty times its count in the output so far, and the presence penalty once
    if it is there. The test's own, independent of the server's sampler."""

    def __init__(self, prompt_length: int, frequency: float, presence: float) -> None:
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_length :].tolist()):
            for token in set(ids):
                scores[row, token] -= torch.tensor(self.frequency) * ids.count(token)
                scores[row, token] -= torch.tensor(self.presence)
        return scores


def test_penalties_defaults_batched_prompts_and_scoring_as_vllm_answers_them(server) -> None:
    """Issue 56 points 1, 3 and 4 through the server: penalties and a logit bias give
    transformers' generate with the same settings; a request without temperature samples
    at vLLM's 1.0; chat without a limit goes on to max_seq_len; max_completion_tokens limits
    completions (and guidellm's requests, which send it, run); any number of stop strings, with the stop reason named; a list of prompts
    gets prompt x n choices in order, streamed alike; max_tokens 0 with echo scores the
    prompt alone."""
    import openai
    import torch
    from transformers import AutoTokenizer, LogitsProcessorList

    base, key, checkpoint = server
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    greedy = {"temperature": 0, "max_tokens": 10}
    prompt = "the quick brown fox"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    plain = greedy_ids(checkpoint, ids[0].tolist(), 10)

    def reference(**settings) -> str:
        out = reference_generate(
            checkpoint,
            ids,
            num_threads=1,
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            **settings,
        )[0, ids.shape[1] :].tolist()
        assert out != plain, settings  # the setting changes the text: the test can fail
        return tokenizer.decode(out, skip_special_tokens=True)

    def served(**extra) -> str:
        extra = {"ignore_eos": True, **extra}
        done = client.completions.create(
            model="tiny-llama", prompt=prompt, **greedy, extra_body=extra
        )
        return done.choices[0].text

    assert served(repetition_penalty=1.6) == reference(repetition_penalty=1.6)
    bias = {plain[1]: -100.0, plain[3]: -7.5}
    assert served(logit_bias={str(t): b for t, b in bias.items()}) == reference(
        sequence_bias={(t,): b for t, b in bias.items()}
    )
    assert served(logit_bias={str(plain[1]): -1e9}) == served(logit_bias={str(plain[1]): -100})
    penalties = OutputPenalties(ids.shape[1], frequency=1.5, presence=0.5)
    assert served(frequency_penalty=1.5, presence_penalty=0.5) == reference(
        logits_processor=LogitsProcessorList([penalties])
    )
    status, body = post(
        f"{base}/completions",
        json.dumps({"prompt": prompt, "logit_bias": {"600": 1}}).encode(),
        key,
    )
    assert status == 400 and body["error"]["param"] == "logit_bias", body

    # vLLM's defaults: no temperature samples at 1.0; chat without a limit: the rest of the KV
    unset = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, seed=3)
    at_one = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=8, seed=3, temperature=1.0
    )
    zero = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0)
    assert unset.choices[0].text == at_one.choices[0].text != zero.choices[0].text
    assert (
        client.completions.create(model="tiny-llama", prompt=prompt).usage.completion_tokens <= 16
    )
    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hello there"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 64
    limited = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        temperature=0,
        extra_body={"max_completion_tokens": 3, "ignore_eos": True},
    )
    assert limited.usage.completion_tokens == 3
    # guidellm's requests as its OpenAI backend writes them: max_tokens and
    # max_completion_tokens both, ignore_eos, no temperature (sampled), streamed with usage;
    # chat content as text parts
    for chat in (False, True):
        shape = {
            "model": "tiny-llama",
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"max_completion_tokens": 6, "ignore_eos": True},
        }
        if chat:
            parts = [{"type": "text", "text": "hello there"}]
            chunks = client.chat.completions.create(
                messages=[{"role": "user", "content": parts}], **shape
            )
        else:
            chunks = client.completions.create(prompt=prompt, **shape)
        chunks = list(chunks)
        assert chunks[-1].usage.completion_tokens == 6, chat

    # stops: any number; the stop reason is the string, the asked token, or None
    text = tokenizer.decode(plain, skip_special_tokens=True)
    stops = ["never \u2603", "nor this", "x-x", "q!q", "zz zz", text[3:6]]
    cut = client.completions.create(
        model="tiny-llama", prompt=prompt, **greedy, stop=stops, extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == text[: text.find(text[3:6])]
    assert cut.choices[0].stop_reason == text[3:6] and cut.choices[0].finish_reason == "stop"
    by_token = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        **greedy,
        extra_body={"ignore_eos": True, "stop_token_ids": [plain[4]]},
    )
    assert by_token.choices[0].stop_reason == plain[4]
    long = client.completions.create(
        model="tiny-llama", prompt=prompt, **greedy, extra_body={"ignore_eos": True}
    )
    assert long.choices[0].stop_reason is None and long.choices[0].finish_reason == "length"

    # a list of prompts: prompt x n choices, in order; token lists too; streamed alike
    other = "once upon a time"
    other_ids = tokenizer(other)["input_ids"]
    expected = [text] * 2 + [
        tokenizer.decode(greedy_ids(checkpoint, other_ids, 10), skip_special_tokens=True)
    ] * 2
    batched = client.completions.create(
        model="tiny-llama", prompt=[prompt, other], n=2, **greedy, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    assert [c.text for c in batched.choices] == expected
    assert batched.usage.prompt_tokens == ids.shape[1] + len(other_ids)
    assert batched.usage.completion_tokens == 40
    as_ids = client.completions.create(
        model="tiny-llama",
        prompt=[ids[0].tolist(), other_ids],
        **greedy,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in as_ids.choices] == expected[::2]
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(
        model="tiny-llama",
        prompt=[prompt, other],
        n=2,
        stream=True,
        **greedy,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == expected

    # max_tokens 0 with echo: the prompt and its scores, nothing generated
    scored = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    one = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    n = ids.shape[1]
    assert scored.choices[0].logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:n]
    assert len(scored.choices[0].logprobs.tokens) == n
    status, body = post(
        f"{base}/completions", json.dumps({"prompt": prompt, "max_tokens": 0}).encode(), key
    )
    assert status == 400 and "echo" in body["error"]["message"], body
    assert torch.is_tensor(ids)


def test_logprobs_echo_n_and_streams_as_vllm_serves_them(server) -> None:
    """Completions' logprobs with echo (prompt scoring: the first prompt token unscored) and
    chat's logprobs/top_logprobs equal transformers' log_softmax of the same checkpoint's
    logits, streamed alike; n choices, choice i seeded seed + i; best_of other than n and
    chat echo refused by name; special tokens kept when asked; a stream's first chunk leaves
    with its first token."""
    import openai
    import torch
    from transformers import AutoTokenizer

    base, key, checkpoint = server
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    prompt = "the quick brown fox"
    prompt_ids = tokenizer(prompt)["input_ids"]
    new = greedy_ids(checkpoint, prompt_ids, 5)
    done = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=5, logprobs=3, echo=True, **greedy
    )
    choice, scores = done.choices[0], done.choices[0].logprobs
    assert choice.text == prompt + tokenizer.decode(new, skip_special_tokens=True)
    everything = prompt_ids + new
    assert scores.tokens == [tokenizer.decode([t]) for t in everything]
    logp = reference_logprobs(checkpoint, everything[:-1])
    want = logp[torch.arange(len(everything) - 1), torch.tensor(everything[1:])]
    assert scores.token_logprobs[0] is None and scores.top_logprobs[0] is None
    assert torch.allclose(torch.tensor(scores.token_logprobs[1:]), want, atol=1e-4, rtol=0)
    for position, top in enumerate(scores.top_logprobs[1:]):
        best = torch.topk(logp[position], 3)
        top_ids = best.indices.tolist()
        expected = {tokenizer.decode([i]): v for i, v in zip(top_ids, best.values, strict=True)}
        assert set(expected) <= set(top) and len(top) <= 4  # the top 3 and the token itself
        assert all(abs(top[t] - v) < 1e-4 for t, v in expected.items())
    assert scores.text_offset[:2] == [0, len(scores.tokens[0])]
    chunks = list(  # as a stream: the same scores, the prompt's first
        client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=5,
            logprobs=3,
            echo=True,
            stream=True,
            **greedy,
        )
    )
    streamed = [
        v
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for v in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(scores.token_logprobs[1:], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text

    # chat: logprobs true, top_logprobs 2, streamed alike
    messages = [{"role": "user", "content": "hello there"}]
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"][0].tolist()
    chat_new = greedy_ids(checkpoint, chat_ids, 4)
    chat = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=4, logprobs=True, top_logprobs=2, **greedy
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in chat_new]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    logp = reference_logprobs(checkpoint, chat_ids + chat_new[:-1])
    rows = torch.arange(len(chat_ids) - 1, len(chat_ids) - 1 + len(content))
    want = logp[rows, torch.tensor(chat_new)]
    assert [c.logprob for c in content] == pytest.approx(want.tolist(), abs=1e-4)
    best = torch.topk(logp[rows], 2)
    assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
        best.values.flatten().tolist(), abs=1e-4
    )
    deltas = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=messages,
            max_tokens=4,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **greedy,
        )
    )
    assert deltas[0].choices[0].delta.role == "assistant"
    again = [
        c
        for d in deltas
        if d.choices and d.choices[0].logprobs
        for c in d.choices[0].logprobs.content
    ]
    assert [c.logprob for c in again] == pytest.approx([c.logprob for c in content], abs=1e-6)

    # n: choice i draws with seed + i, so choice 1 of seed 5 is choice 0 of seed 6
    sampled = {"temperature": 1.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    two = client.completions.create(model="tiny-llama", prompt=prompt, seed=5, n=2, **sampled)
    one = client.completions.create(model="tiny-llama", prompt=prompt, seed=6, **sampled)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 16
    assert two.choices[1].text == one.choices[0].text
    parts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model="tiny-llama", prompt=prompt, seed=5, n=2, stream=True, **sampled
    ):
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[0], parts[1]] == [c.text for c in two.choices]
    with pytest.raises(openai.BadRequestError, match="'best_of'=3 is not supported") as caught:
        client.completions.create(model="tiny-llama", prompt=prompt, n=2, best_of=3)
    assert caught.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError, match="'echo'=true is not supported"):
        client.chat.completions.create(
            model="tiny-llama", messages=messages, extra_body={"echo": True}
        )
    # skip_special_tokens=false: special tokens are text (the echoed prompt's bos here)
    kept = client.completions.create(
        model="tiny-llama",
        prompt=[1, *prompt_ids],
        max_tokens=3,
        echo=True,
        temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert kept.choices[0].text.startswith("<|bos|>" + prompt)
    # a stream's first chunk leaves with its first token (its usage says 1 token)
    first = next(
        iter(
            client.completions.create(
                model="tiny-llama",
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
            )
        )
    )
    assert first.usage.completion_tokens == 1


def test_an_independent_harness_and_load_generator_at_1_8_and_32_streams(server) -> None:
    """What vLLM-compatible tools send, from tools that are not ours: lm-eval's
    `local-completions` and `local-chat-completions` models (used programmatically: no data
    set download) score continuations through /v1/completions' echo + logprobs equal to
    transformers' log-likelihoods of the same checkpoint, and generate at 1, 8 and 32
    concurrent requests on both endpoints; the official async client runs 1, 8 and 32
    concurrent streams on both: every request succeeds, each ignore_eos request returns
    exactly max_tokens tokens of transformers' greedy text, and every stream's first chunk
    leaves with its first token (its usage says 1 completion token)."""
    import asyncio

    import openai
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI
    from transformers import AutoTokenizer

    base, key, checkpoint = server
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    header = {"Authorization": f"Bearer {key}"}
    new = 8
    prompts = ["the cat sat on", "a dog ran to the", "story of the mat", "the quick brown"]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    expected = [
        tokenizer.decode(
            greedy_ids(checkpoint, tokenizer(p)["input_ids"], new), skip_special_tokens=True
        )
        for p in prompts
    ]
    chat_ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"]
        for m in chats
    ]
    expected_chat = [
        tokenizer.decode(greedy_ids(checkpoint, ids, new), skip_special_tokens=True)
        for ids in chat_ids
    ]

    # lm-eval: prompt scoring (log-likelihood of continuations) equals transformers', its
    # requests batched (a list of token lists per request: one choice each, in order)
    pairs = [("the cat sat on", " the mat"), ("a dog ran", " to the cat and sat"), ("x", " y")]
    scorer = LocalCompletionsAPI(
        base_url=f"{base}/completions",
        model="tiny-llama",
        tokenizer=checkpoint,
        num_concurrent=8,
        batch_size=2,
        max_retries=1,
        header=header,
    )
    scored = scorer.loglikelihood(
        [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
        disable_tqdm=True,
    )
    for (context, continuation), (logprob, greedy) in zip(pairs, scored, strict=True):
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        ids = context_ids + tokenizer(continuation, add_special_tokens=False)["input_ids"]
        logp = reference_logprobs(checkpoint, ids)
        targets = range(len(context_ids), len(ids))
        want = sum(logp[i - 1, ids[i]].item() for i in targets)
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == all(logp[i - 1].argmax().item() == ids[i] for i in targets)

    # lm-eval: generation at 1, 8 and 32 concurrent requests, both endpoints
    until = {"until": ["\u2603"], "max_gen_toks": new, "ignore_eos": True}
    for concurrent in (1, 8, 32):
        for model, contexts, want in (
            (LocalCompletionsAPI, prompts, expected),
            (LocalChatCompletion, [JsonChatStr(json.dumps(m)) for m in chats], expected_chat),
        ):
            endpoint = "completions" if model is LocalCompletionsAPI else "chat/completions"
            harness = model(
                base_url=f"{base}/{endpoint}",
                model="tiny-llama",
                tokenizer=checkpoint if model is LocalCompletionsAPI else None,
                tokenizer_backend="huggingface" if model is LocalCompletionsAPI else None,
                tokenized_requests=model is LocalCompletionsAPI,
                num_concurrent=concurrent,
                max_retries=1,
                header=header,
            )
            requests = [
                Instance("generate_until", {}, (contexts[i % 4], dict(until)), i)
                for i in range(concurrent)
            ]
            texts = harness.generate_until(requests, disable_tqdm=True)
            assert texts == [want[i % 4] for i in range(concurrent)], (endpoint, concurrent)

    # the official async client: 1, 8 and 32 concurrent streams on both endpoints
    async def stream(client, i: int, chat: bool) -> tuple[str, int, int]:
        options = {
            "model": "tiny-llama",
            "max_tokens": new,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "extra_body": {"ignore_eos": True},
        }
        if chat:
            chunks = await client.chat.completions.create(messages=chats[i % 4], **options)
        else:
            chunks = await client.completions.create(prompt=prompts[i % 4], **options)
        text, first, last = "", None, None
        async for chunk in chunks:
            first = chunk.usage.completion_tokens if first is None else first
            last = chunk.usage.completion_tokens
            for c in chunk.choices:
                text += (c.delta.content or "") if chat else c.text
        return text, first, last

    async def load(concurrent: int, chat: bool) -> list:
        async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0) as client:
            return await asyncio.gather(*(stream(client, i, chat) for i in range(concurrent)))

    for concurrent in (1, 8, 32):
        for chat, want in ((False, expected), (True, expected_chat)):
            results = asyncio.run(load(concurrent, chat))
            assert results == [(want[i % 4], 1, new) for i in range(concurrent)], (
                chat,
                concurrent,
            )


def metrics(base: str, key: str) -> dict[str, float]:
    """The server's /metrics (Prometheus text), unlabelled: name -> value (a histogram's
    buckets as NAME[le], a series per finished_reason as NAME[reason] and summed as NAME)."""
    request = urllib.request.Request(
        base.removesuffix("/v1") + "/metrics", headers={"Authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, labels = series.split("{", 1)
            le = re.search(r'le="([^"]+)"', labels)
            reason = re.search(r'finished_reason="([^"]+)"', labels)
            if reason:
                values[f"{name}[{reason.group(1)}]"] = float(value)
                values[name] = values.get(name, 0.0) + float(value)
            else:
                values[f"{name}[{le.group(1)}]" if le else name] = float(value)
    return values


def test_clients_beyond_max_batch_wait_their_turn_and_get_their_text(server) -> None:
    """max_batch is 2; 8 clients at once (the official client, greedy): every one gets 200 and
    transformers' text for its prompt, none 429; the queue held the rest; /metrics counts them
    under vLLM's names."""
    import openai
    from transformers import AutoTokenizer

    base, key, checkpoint = server
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [f"story {i} of the cat" for i in range(8)]
    expected = [
        greedy_text(checkpoint, tokenizer, tokenizer(p, return_tensors="pt")["input_ids"], 24)
        for p in prompts
    ]
    before = metrics(base, key)
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            done = client.completions.create(
                model="tiny-llama", prompt=prompts[i], max_tokens=24, temperature=0
            )
            results[i] = done.choices[0].text
        except openai.APIStatusError as exc:
            results[i] = exc.status_code

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == expected
    after = metrics(base, key)
    assert after["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 8
    assert after["vllm:time_to_first_token_seconds_bucket[+Inf]"] >= 8
    assert after["vllm:kv_cache_usage_perc"] <= 1.0
    # the offloaders' counters follow the engine's (its one stage holds every layer: nothing
    # crossed), with the per-token gauge once tokens were generated
    assert after["offload:copied_bytes_total"] == after["offload:copied_bytes_per_token"] == 0


def test_a_client_that_leaves_mid_stream_frees_its_request(served) -> None:
    """A client that drops a stream after its first token, while its request certainly still
    runs (the engine's token gate is closed: it applies no second token until a request is
    cancelled): the server cancels the request, which ends with that one token of the 50 it
    asked for (ignore_eos: nothing else ends it sooner) and frees its KV slot; the server goes
    on. Were the request not cancelled, it would hold its slot until the gate opens, then run
    to 50 tokens."""
    import openai

    base, key = served.base, served.key
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    before = metrics(base, key)
    served.gate.unlink()  # closed: no token after a request's first, until a cancel
    try:
        stream = client.completions.create(
            model="tiny-llama",
            prompt="once upon",
            max_tokens=50,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # the first token: the engine now holds the request's second
        stream.close()  # gone mid-stream
        ended = before["vllm:request_success_total"] + 1
        deadline = time.monotonic() + 60  # a bound on failing only: the cancel ends the hold
        while (after := metrics(base, key))["vllm:request_success_total"] < ended:
            assert time.monotonic() < deadline, "the dropped stream was not cancelled: it runs"
            time.sleep(0.2)
    finally:
        served.gate.touch()  # open again, whatever happened: the module's other requests
    assert after["vllm:request_success_total"] == ended
    aborted = after["vllm:request_success_total[abort]"]
    assert aborted == before["vllm:request_success_total[abort]"] + 1  # vLLM's finished_reason
    assert after["vllm:num_requests_running"] == 0
    assert after["offload:kv_cache_blocks_used"] == 0  # its slot's blocks are free
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == 1, f"{generated} tokens: the request was not cut after its first"
    done = client.completions.create(model="tiny-llama", prompt="a b", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length")


def test_sigterm_stops_the_server_and_its_embedded_ray(served) -> None:
    """Last in this module: SIGTERM (a service manager's stop) ends the server with 143 within
    the bound, one line and no traceback, and no process of its embedded Ray is left: neither
    one whose command line names its session directory (GCS, raylet, dashboard, monitors) nor
    any process the command had spawned (Serve's controller, proxy and replica, the worker)."""
    assert {"gcs_server", "raylet"} <= names_of(served.spawned)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=STOP_TIMEOUT_S) == 143, served.log()
    log = served.log()
    assert "terminated: every worker and Ray this command started was released" in log, log
    assert "Traceback" not in log, log
    deadline = time.monotonic() + 10  # reaped: the command waited for each of them to end
    while left := ray_session_processes(served.session) + still_running(served.spawned):
        assert time.monotonic() < deadline, f"left running: {sorted(names_of(left))}"
        time.sleep(0.2)
