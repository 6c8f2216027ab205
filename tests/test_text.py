"""coordinator.serving.text.TextStream: tokens to text deltas as they come, with OpenAI-style stop
strings, on the real (tiny, trained) tokenizer make-checkpoint writes."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.serving import text as text_module
from coordinator.serving.text import TextStream
from coordinator.tools.tiny_tokenizer import TEXT as PROSE  # what the tokenizer was trained on

TEXT = "the cat sat on the mat. the dog ran to the cat and sat."


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


def test_no_stop_string_in_the_text_of_the_first_min_tokens(tokenizer) -> None:
    """vLLM's min_tokens: a stop string in the first min_tokens tokens' text is text; one
    after them stops it."""
    ids = tokenizer("the cat and the cat")["input_ids"]
    first = len(tokenizer("the cat")["input_ids"])
    stream = TextStream(tokenizer, (), ("cat",), min_tokens=first)
    text = "".join(stream.push(i) for i in ids)
    assert stream.stopped and text == "the cat and the "


def test_an_empty_stop_string_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="stop string must not be empty"):
        TextStream(tokenizer, (), ("x", ""))


# Incremental decoding: only a short window of recent ids is decoded per token, and the deltas
# still add up to decoding every id at once, multi-byte characters and garbage bytes included.
MULTIBYTE = (
    "héllo wörld, naïve café",
    "中文 日本語のテキスト 한국어",
    "emoji 🙂👍🏽 and a flag 🇫🇷 then a family 👨‍👩‍👧",
    "  two leading spaces,\ttabs\n\nand newlines  ",
    "the cat 🐈 sat on the mat. ∑ x² ≠ ∞ — “quotes” «too»",
)


def byte_ids(tokenizer) -> list[int]:
    """Ids of the tokens that are one byte of a multi-byte character (they decode alone to a
    replacement character): random runs of them make incomplete and invalid UTF-8."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]


def streamed(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, TextStream]:
    """Every delta of `ids` pushed one by one, plus `finish()`, joined."""
    stream = TextStream(tokenizer, (), stop)
    out = "".join(stream.push(i) for i in ids)
    return out + stream.finish(), stream


@pytest.mark.parametrize("text", MULTIBYTE, ids=range(len(MULTIBYTE)))
def test_multibyte_text_streams_back_exactly(tokenizer, text) -> None:
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer)
    deltas = [stream.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)  # a split character waits until whole
    assert "".join(deltas) + stream.finish() == tokenizer.decode(ids) == text


@pytest.mark.parametrize("length", [1, 2, 3, 7, 40, 300, 1500])
@pytest.mark.parametrize("bytes_share", [0.0, 0.5, 0.95])
def test_random_ids_stream_back_as_the_whole_decode(tokenizer, length, bytes_share) -> None:
    rng = random.Random(length * 100 + int(bytes_share * 100))
    pieces = byte_ids(tokenizer)
    ids = [
        rng.choice(pieces) if rng.random() < bytes_share else rng.randrange(len(tokenizer))
        for _ in range(length)
    ]
    out, _ = streamed(tokenizer, ids)
    assert out == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_ids_and_stop_string_stream_as_the_whole_decode(tokenizer, data) -> None:
    pieces = byte_ids(tokenizer)
    ids = data.draw(
        st.lists(
            st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(pieces)), max_size=60
        )
    )
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    out, stream = streamed(tokenizer, ids)
    assert out == whole and not stream.stopped
    if whole:  # a stop string from the text itself: the text ends where it first begins
        start = data.draw(st.integers(0, len(whole) - 1))
        stop = whole[start : data.draw(st.integers(start + 1, min(len(whole), start + 6)))]
        out, stream = streamed(tokenizer, ids, (stop,))
        assert out == whole[: whole.find(stop)] and stream.stop_string == stop


class CountingTokenizer:
    """The tokenizer, recording how many ids each `decode` is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def decode(self, ids, **kwargs) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def long_stream_ids(tokenizer) -> list[int]:
    """2,000 ids: text with multi-byte characters, and in its middle a run of garbage bytes
    (incomplete and invalid UTF-8) and a run of special tokens."""
    prose = "".join(MULTIBYTE) + PROSE + " the cab and the co-op. "
    ids: list[int] = []
    while len(ids) < 1800:
        ids += tokenizer(prose)["input_ids"]
    del ids[1800:]
    ids[900:900] = [*random.Random(0).choices(byte_ids(tokenizer), k=150), *[0] * 50]
    return ids


def test_every_decode_is_of_a_short_window_however_long_the_sequence(tokenizer) -> None:
    ids = long_stream_ids(tokenizer)
    counting = CountingTokenizer(tokenizer)
    out, stream = streamed(counting, ids, ("the cow",))
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert out == whole == stream.text and len(whole) > 3000 and not stream.stopped
    assert stream.finish() == ""  # all was handed out
    # the old stream decoded all the ids so far for every token: up to 2,000 at once
    assert max(counting.sizes) <= 16 and len(counting.sizes) <= 3 * len(ids)


def test_every_stop_string_search_is_of_a_short_text(tokenizer, monkeypatch) -> None:
    """Handed-out text never holds the start of a stop string: only what is held back (shorter
    than the stop string) and the new delta are searched, not the 3,000 characters so far."""
    ids = long_stream_ids(tokenizer)
    searched: list[int] = []
    first_stop = text_module._first_stop
    monkeypatch.setattr(
        text_module,
        "_first_stop",
        lambda text, stops: searched.append(len(text)) or first_stop(text, stops),
    )
    stop = "the cow"  # never comes, but "the c" keeps being held back
    stream = TextStream(tokenizer, (), (stop,))
    out = ""
    for i in ids:
        out += stream.push(i)
        assert len(stream._held) < len(stop)
    out += stream.finish()
    assert out == tokenizer.decode(ids, skip_special_tokens=True) and stop not in out
    assert len(searched) > 1000 and max(searched) <= 64


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama-style sentencepiece tokenizer ("▁" for a space, byte fallback, the leading
    space of the text stripped by the decoder): a window decoded alone loses the space its
    first token begins with, which the stream's prefix window restores."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    trained.train_from_iterator(
        [PROSE], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


@pytest.mark.parametrize("text", [PROSE, *MULTIBYTE], ids=range(len(MULTIBYTE) + 1))
def test_sentencepiece_spaces_and_bytes_stream_back_exactly(sentencepiece_tokenizer, text) -> None:
    tokenizer = sentencepiece_tokenizer
    ids = tokenizer(text)["input_ids"]
    # a word after the first begins with "▁", which decoded alone is no space
    spaced = [i for i in ids[1:] if tokenizer.convert_ids_to_tokens(i).startswith("▁")]
    assert spaced and not tokenizer.decode(spaced[:1]).startswith(" ")
    out, _ = streamed(tokenizer, ids)
    assert out == tokenizer.decode(ids, skip_special_tokens=True) == text


def byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level token of one byte (GPT-2's byte-to-unicode mapping)."""
    return tokenizer.convert_tokens_to_ids(text_module.byte_level_char(byte))


def test_bytes_that_cannot_complete_leave_as_u_fffd_at_the_next_token(tokenizer) -> None:
    """Invalid UTF-8: a lead byte followed by another lead byte, a lone continuation byte, a
    truncated character before plain text. Each replacement character leaves with the token
    that shows it cannot complete; at most one incomplete character is held back. The text
    equals decoding all at once (`tokenizers` decodes bytes lossily)."""
    lead3, cont, a = (
        byte_token(tokenizer, 0xE2),
        byte_token(tokenizer, 0x82),
        tokenizer("a")["input_ids"][0],
    )
    stream = TextStream(tokenizer)
    deltas = [stream.push(i) for i in (lead3, lead3, cont, lead3, a)]
    # E2: may complete; E2: the first cannot (held: the second); 82: E2 82 may complete;
    # E2: E2 82 cannot; "a": the last E2 cannot
    assert deltas == ["", "\ufffd", "", "\ufffd", "\ufffda"]
    assert "".join(deltas) + stream.finish() == tokenizer.decode([lead3, lead3, cont, lead3, a])
    stream = TextStream(tokenizer)
    assert [stream.push(i) for i in (cont, cont, a)] == ["", "\ufffd", "\ufffda"]


def test_special_tokens_are_text_when_not_skipped(tokenizer) -> None:
    ids = [
        *tokenizer("the cat")["input_ids"],
        tokenizer.eos_token_id,
        3,
        *tokenizer(" sat")["input_ids"],
    ]
    stream = TextStream(tokenizer, skip_special_tokens=False)
    out = "".join(stream.push(i) for i in ids) + stream.finish()
    assert (
        out
        == tokenizer.decode(ids, skip_special_tokens=False)
        == "the cat<|im_end|><|im_start|> sat"
    )
    skipped = TextStream(tokenizer)
    assert "".join(skipped.push(i) for i in ids) + skipped.finish() == "the cat sat"
