"""Guided decoding (issue 56 point 7), on outlines-core: the last stage masks a guided row's
logits to the tokens its regex allows next. Greedy guided texts equal transformers' `generate`
constrained to the same tokens (its PrefixConstrainedLogitsProcessor, fed by outlines-core's
own Guide: the library, not our masking), through two stages and preemptions; sampled ones
match the regex (Python's `re`) or parse as the schema asks; a regex the vocabulary cannot
spell is refused where it enters."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import tiny_shape
from test_families import Pipeline

from coordinator.engine import Engine, EngineConfig
from coordinator.engine.engine import model_steps
from coordinator.engine.pipelines import LocalPipeline
from coordinator.planning.checkpoint import load_index
from coordinator.serving.app import MAX_GUIDE_REGEX_CHARS, BadRequest, guide_of
from coordinator.serving.text import load_tokenizer
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_generate
from worker.guided import GuideBook, Guided, GuideError, allowed, token_bytes, words_for
from worker.steps import Sampling

outlines_core = pytest.importorskip("outlines_core")

WAIT_S = 120.0
MAX_SEQ_LEN = 64
TWO_STAGES = (
    [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]],
    ("layers.1",),
)
CHOICES = ["the cat", "the dog", "a boat"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("guided") / "ckpt"
    shape = tiny_shape(4, hidden_size=32, intermediate_size=48, vocab_size=512, max_positions=256)
    return load_index(make_checkpoint(root, shape))


@pytest.fixture(scope="module")
def tokenizer(index):
    return load_tokenizer(index.root)


def regex_of(field: str, value) -> str:
    return guide_of({field: value})[1]


def test_each_tokens_bytes_are_the_text_it_adds(tokenizer) -> None:
    table = token_bytes(tokenizer)
    assert not set(table) & set(tokenizer.all_special_ids)
    whole = [i for i, data in table.items() if _utf8(data)]
    assert len(whole) > 200
    for token_id in whole:
        assert table[token_id].decode() == tokenizer.decode([token_id]), token_id
    # and a text is the bytes of its tokens, in order
    text = "The little town sat between the hills and the sea."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(table[i] for i in ids).decode() == text


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_a_guides_mask_follows_its_automaton_and_starts_over_when_a_position_repeats(
    tokenizer,
) -> None:
    book = GuideBook(tokenizer=tokenizer)
    regex = regex_of("guided_choice", CHOICES)
    guided = Guided(book, regex)
    words = words_for(512)
    prompt = [5, 6, 7]

    def options(tokens) -> set[int]:
        return set(allowed(guided.mask(tokens, len(prompt), words)[None], 512)[0].nonzero()[:, 0])

    first = {int(t) for t in options(prompt)}
    assert first and all(
        any(c.encode().startswith(token_bytes(tokenizer)[t]) for c in CHOICES) for t in first
    )
    spelled = tokenizer("the cat", add_special_tokens=False)["input_ids"]
    end = tokenizer.eos_token_id
    assert {int(t) for t in options(prompt + spelled)} == {end}
    # an end token that did not end the row (ignore_eos): the end token alone, as long as it
    # runs; anything else after it is refused by name
    assert {int(t) for t in options(prompt + spelled + [end])} == {end}
    assert {int(t) for t in options(prompt + spelled + [end, end])} == {end}
    with pytest.raises(ValueError, match="follows its guide's end"):
        options(prompt + spelled + [end, end, spelled[0]])
    assert {int(t) for t in options(prompt)} == first  # the same position again: from the start
    with pytest.raises(GuideError, match="cannot be used"):
        book.index("(unclosed")  # not a regex


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_choice", CHOICES),
        ("guided_regex", r"(yes|no), [0-9]{2}"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        ),
    ],
    ids=["choice", "regex", "json_schema"],
)
def test_greedy_guided_text_equals_transformers_constrained_to_the_same_tokens(
    index, tokenizer, field, value
) -> None:
    """Two prompts, one guided and one not, in one batch through two stages: the guided
    one's tokens equal generate's with prefix_allowed_tokens_fn from outlines-core's own
    Guide; the other's are generate's plain greedy ones (nothing leaks between rows)."""
    regex = regex_of(field, value)
    prompt = tokenizer("The boats went out", add_special_tokens=False)["input_ids"]
    other = tokenizer("Children ran down to", add_special_tokens=False)["input_ids"]
    new = 40
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        engine = Engine(
            LocalPipeline(pipeline.workers),
            EngineConfig(num_slots=2, max_seq_len=MAX_SEQ_LEN, **model_steps(index)),
        )
        try:
            eos = (tokenizer.eos_token_id,)
            guided = engine.submit(
                [prompt], sampling=Sampling(guide=regex), max_new_tokens=new, eos_token_ids=eos
            )
            plain = engine.submit([other], sampling=Sampling(), max_new_tokens=8)
            ours, theirs = guided.result(WAIT_S)[0], plain.result(WAIT_S)[0]
        finally:
            engine.close()
    finally:
        pipeline.close()
    expected = constrained(index, tokenizer, prompt, regex, new)
    assert ours == expected
    text = tokenizer.decode(ours, skip_special_tokens=True)
    if field == "response_format":
        parsed = json.loads(text)
        assert set(parsed) == {"name", "ok"} and isinstance(parsed["ok"], bool)
    else:
        assert re.fullmatch(regex, text), text
    assert (
        theirs
        == reference_generate(
            str(index.root),
            torch.tensor([other]),
            num_threads=1,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
        )[0, len(other) :].tolist()
    )


def test_a_guided_row_its_end_token_does_not_end_runs_to_its_limit_on_the_end_token(
    index, tokenizer
) -> None:
    """`ignore_eos` (no end tokens) on a guided row whose text is complete before its limit:
    the guide allows only the end token, which no longer ends the row. It runs to its limit
    on the end token (its text the guide's, as transformers' constrained greedy writes it)
    instead of failing at the token after the end."""
    regex = regex_of("guided_choice", CHOICES)
    prompt = tokenizer("The boats went out", add_special_tokens=False)["input_ids"]
    new = 12
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        engine = Engine(
            LocalPipeline(pipeline.workers),
            EngineConfig(num_slots=1, max_seq_len=MAX_SEQ_LEN, **model_steps(index)),
        )
        try:
            ours = engine.submit(
                [prompt], sampling=Sampling(guide=regex), max_new_tokens=new, eos_token_ids=()
            ).result(WAIT_S)[0]
        finally:
            engine.close()
    finally:
        pipeline.close()
    expected = constrained(index, tokenizer, prompt, regex, new)
    end = tokenizer.eos_token_id
    assert expected[-1] == end and len(expected) < new  # the guide's text ends first
    assert ours == expected + [end] * (new - len(expected))
    assert tokenizer.decode(ours, skip_special_tokens=True) in CHOICES


def constrained(index, tokenizer, prompt: list[int], regex: str, new: int) -> list[int]:
    """transformers' greedy `generate`, each step allowed only what outlines-core's Guide
    allows after the tokens so far, ended at the end token."""
    book = GuideBook(tokenizer=tokenizer)
    guide = outlines_core.Guide(book.index(regex))
    fed = [0]

    def allowed_now(_, ids: torch.Tensor) -> list[int]:
        for token in ids[len(prompt) + fed[0] :].tolist():
            guide.advance(token)
            fed[0] += 1
        return list(guide.get_tokens())

    out = reference_generate(
        str(index.root),
        torch.tensor([prompt]),
        num_threads=1,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        prefix_allowed_tokens_fn=allowed_now,
    )[0, len(prompt) :].tolist()
    end = tokenizer.eos_token_id
    return out[: out.index(end) + 1] if end in out else out


def test_sampled_guided_rows_match_through_preemptions(index, tokenizer) -> None:
    """Sampled rows of a guide in a KV pool of one sequence (preempted, fed again: the last
    stage gets their tokens again and its automaton starts over): every text matches."""
    regex = regex_of("guided_regex", r"(the|a) (cat|dog|boat)s? (sat|ran)\.")
    prompt = tokenizer("Every morning the fishing boats went out", add_special_tokens=False)[
        "input_ids"
    ]
    pipeline = Pipeline(index, *TWO_STAGES)
    try:
        engine = Engine(
            LocalPipeline(pipeline.workers),
            EngineConfig(
                num_slots=3,
                max_seq_len=40,
                num_blocks=10,
                block_size=4,
                micro_batches=1,
                burst_steps=1,
                **model_steps(index),
            ),
        )
        try:
            requests = [
                engine.submit(
                    [prompt],
                    sampling=Sampling(do_sample=True, temperature=1.5, guide=regex),
                    max_new_tokens=40 - len(prompt),
                    eos_token_ids=(tokenizer.eos_token_id,),
                    seed=seed,
                )
                for seed in range(6)
            ]
            texts = [
                tokenizer.decode(r.result(WAIT_S)[0], skip_special_tokens=True) for r in requests
            ]
        finally:
            engine.close()
    finally:
        pipeline.close()
    assert engine.stats.preemptions >= 1
    assert all(re.fullmatch(regex, t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled: the seeds drew different texts


def test_guide_fields_are_read_as_vllm_reads_them() -> None:
    assert guide_of({}) == (None, None)
    assert guide_of({"response_format": {"type": "text"}}) == (None, None)
    field, regex = guide_of({"guided_choice": ["a.b", "c d"]})
    assert (
        field == "guided_choice" and re.fullmatch(regex, "a.b") and not re.fullmatch(regex, "axb")
    )
    assert guide_of({"structured_outputs": {"regex": "[0-9]+"}}) == ("structured_outputs", "[0-9]+")
    as_text = guide_of({"guided_json": json.dumps(SCHEMA)})[1]
    assert as_text == guide_of({"guided_json": SCHEMA})[1]
    assert re.fullmatch(as_text, '{"name": "ab", "ok": true}')
    assert guide_of({"response_format": {"type": "json_object"}})[1]
    for body, param in (
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ):
        with pytest.raises(BadRequest) as caught:
            guide_of(body)
        assert caught.value.param == param, body
    # a regex past MAX_GUIDE_REGEX_CHARS: its compile takes the square of its length
    long = "\u00e9" * (MAX_GUIDE_REGEX_CHARS + 1)
    for body, param in (
        ({"guided_regex": long}, "guided_regex"),
        ({"guided_choice": [long]}, "guided_choice"),
        ({"structured_outputs": {"regex": long}}, "structured_outputs"),
    ):
        with pytest.raises(BadRequest, match=rf"'{param}': its regex has \d+ characters, over"):
            guide_of(body)
    assert guide_of({"guided_regex": "a" * MAX_GUIDE_REGEX_CHARS})  # the limit itself: taken
