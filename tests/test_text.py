"""coordinator.serving.text.TextStream: tokens to text deltas as they come, with OpenAI-style stop
strings, on the real (tiny, trained) tokenizer make-checkpoint writes."""

from __future__ import annotations

import pytest

from coordinator.serving.text import TextStream, load_tokenizer
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint

TEXT = "the cat sat on the mat. the dog ran to the cat and sat."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("text") / "ckpt"
    make_checkpoint(
        root,
        CheckpointShape(
            num_layers=1,
            hidden_size=16,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=32,
            vocab_size=512,
        ),
    )
    return load_tokenizer(root)


def stream_all(tokenizer, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    """Every delta, token by token, then what `finish` releases (the last item)."""
    stream = TextStream(tokenizer, (tokenizer.eos_token_id,), stop)
    deltas = [stream.push(i) for i in tokenizer(text)["input_ids"]]
    return [*deltas, stream.finish()], stream


def test_deltas_add_up_to_the_whole_decode(tokenizer) -> None:
    deltas, stream = stream_all(tokenizer, TEXT)
    whole = tokenizer.decode(tokenizer(TEXT)["input_ids"], skip_special_tokens=True)
    assert "".join(deltas) == whole == stream.text and len([d for d in deltas if d]) > 5
    assert not stream.stopped and stream.stop_string is None


@pytest.mark.parametrize("stop", [("dog",), ("mat.", "dog"), ("ran", "the d")], ids=str)
def test_text_ends_where_the_first_stop_string_begins(tokenizer, stop) -> None:
    whole = tokenizer.decode(tokenizer(TEXT)["input_ids"], skip_special_tokens=True)
    deltas, stream = stream_all(tokenizer, TEXT, stop)
    first = min(whole.find(s) for s in stop if s in whole)
    assert "".join(deltas) == whole[:first] == stream.text
    assert stream.stopped and whole.startswith(stream.stop_string, first)
    # no delta ever carried a piece of the stop string or what follows it
    assert all(s not in "".join(deltas) for s in stop)


def test_a_possible_start_of_a_stop_string_is_held_back_then_released(tokenizer) -> None:
    stream = TextStream(tokenizer, (), ("the cow",))
    ids = tokenizer("the cat")["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert whole == "the cat"
    partial = "".join(stream.push(i) for i in ids[: len(tokenizer("the c")["input_ids"])])
    assert partial == ""  # "the c" may still become "the cow"
    out = partial + "".join(stream.push(i) for i in ids[len(tokenizer("the c")["input_ids"]) :])
    assert out == "the ca"  # the last "t" could begin "the cow" yet
    assert out + stream.finish() == whole and not stream.stopped


def test_an_end_token_stops_and_later_tokens_are_not_text(tokenizer) -> None:
    stream = TextStream(tokenizer, (tokenizer.eos_token_id,))
    ids = tokenizer("the cat")["input_ids"]
    text = "".join(stream.push(i) for i in [*ids, tokenizer.eos_token_id, *ids])
    assert stream.stopped and stream.stop_string is None
    assert text + stream.finish() == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_empty_stop_string_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="stop string must not be empty"):
        TextStream(tokenizer, (), ("x", ""))
