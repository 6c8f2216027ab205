"""Guided decoding: a sequence's text held to a regular language (a regex, a JSON schema's
regex, a list of choices), as vLLM's guided decoding does, on outlines-core (its Rust
automaton over the tokenizer's vocabulary: which tokens may come next in each state).

`GuideBook` belongs to a checkpoint: its tokenizer's vocabulary as bytes (once), and each
regex's automaton (`Index`, compiled once per regex and kept, a few at a time). `Guided` is
one sequence's place in its automaton, moved along the tokens it chose; its `mask` is the
tokens allowed next, as a bitmask the last stage applies to the row's logits
(`worker.decode`): -inf elsewhere, before anything else, so penalties, temperature, top-k,
top-p and min-p act among the allowed tokens. The end token is allowed only where the text is
complete. Special tokens other than the end token are never allowed. No Ray, no coordinator;
torch only where masks are made (the HTTP front imports this without it).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from offload.errors import ConfigError

if TYPE_CHECKING:
    import torch

INDEXES_KEPT = 16  # compiled automata a book keeps (a JSON schema's takes seconds to compile)


class GuideError(ConfigError):
    """A guide that cannot be used: outlines-core is not installed, or the regex is not one
    it takes; the message says which."""


def _outlines():
    try:
        import outlines_core
    except ImportError:
        raise GuideError(
            "guided decoding needs outlines-core (pip install outlines-core): it is not "
            "installed here"
        ) from None
    return outlines_core


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as in its tokens
    (printable Latin-1 bytes as themselves, the others from U+0100 on), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Each token id's bytes as the text it adds (special tokens left out): byte-level BPE
    tokens through GPT-2's alphabet, sentencepiece's byte tokens (<0xAB>) as that byte and
    its "▁" as a space, other tokens as their text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
    specials = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = _byte_decoder()
    out: dict[int, bytes] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in specials:
            continue
        if byte_level and all(c in decoder for c in token):
            out[token_id] = bytes(decoder[c] for c in token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[token_id] = bytes([int(token[3:5], 16)])
        else:
            out[token_id] = token.replace("\u2581", " ").encode("utf-8")
    return {i: b for i, b in out.items() if b}  # a token that adds nothing is never allowed


class GuideBook:
    """The guides of one tokenizer (`tokenizer`, or the one saved in `checkpoint_dir`, loaded
    at the first guided request): its vocabulary once, each regex's automaton once (the
    INDEXES_KEPT last used). Thread-safe."""

    def __init__(self, checkpoint_dir: str | Path | None = None, tokenizer=None) -> None:
        self._dir, self._tokenizer = checkpoint_dir, tokenizer
        self._vocabulary = None
        self._indexes: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def vocabulary(self):
        with self._lock:
            if self._vocabulary is None:
                tokenizer = self._tokenizer
                if tokenizer is None:
                    if self._dir is None:
                        raise GuideError("guided decoding needs the checkpoint's tokenizer")
                    from transformers import AutoTokenizer

                    try:
                        tokenizer = AutoTokenizer.from_pretrained(self._dir)
                    except Exception as exc:  # no tokenizer saved, or one it cannot read
                        raise GuideError(
                            f"guided decoding needs the checkpoint's tokenizer: {exc}"
                        ) from None
                if tokenizer.eos_token_id is None:
                    raise GuideError("guided decoding needs a tokenizer with an end token")
                words: dict[bytes, list[int]] = {}
                for token_id, data in token_bytes(tokenizer).items():
                    if token_id != tokenizer.eos_token_id:
                        words.setdefault(data, []).append(token_id)
                self._vocabulary = _outlines().Vocabulary(tokenizer.eos_token_id, words)
            return self._vocabulary

    def index(self, regex: str):
        """The automaton of `regex` over the vocabulary (compiled once, then kept)."""
        with self._lock:
            if regex in self._indexes:
                self._indexes.move_to_end(regex)
                return self._indexes[regex]
        vocabulary = self.vocabulary()
        try:
            index = _outlines().Index(regex, vocabulary)
        except (ValueError, RuntimeError, TypeError) as exc:  # outlines-core's refusals
            raise GuideError(f"the guide's regex cannot be used: {exc}") from None
        with self._lock:
            self._indexes[regex] = index
            while len(self._indexes) > INDEXES_KEPT:
                self._indexes.popitem(last=False)
        return index


class Guided:
    """One sequence's place in its guide's automaton, `fed` tokens of its output in."""

    def __init__(self, book: GuideBook, regex: str) -> None:
        self._guide = _outlines().Guide(book.index(regex))
        self._end = book.vocabulary().get_eos_token_id()
        self.fed = 0
        self.ended = False  # the end token was chosen: the text is complete

    def mask(self, tokens: Sequence[int], start: int, words: int) -> torch.Tensor:
        """The tokens allowed after `tokens` (the sequence's so far; its output from `start`
        on) as a bitmask (words,) int32 (bit i of word w: token 32 w + i). The automaton
        moves along the output tokens it has not seen; a position chosen again (a step the
        engine dropped) starts it over.

        The end token (allowed only where the text is complete) has no state after it in the
        automaton. A row whose end token does not end it (`ignore_eos`, or end tokens of its
        own that leave it out) goes on choosing the end token alone until its limit: its text
        stays the guide's, and it still runs to max_tokens as `ignore_eos` asks."""
        import torch

        if self.fed > len(tokens) - start:
            self._guide.reset()
            self.fed, self.ended = 0, False
        for position in range(start + self.fed, len(tokens)):
            token = int(tokens[position])
            if self.ended or token == self._end:
                if token != self._end:  # nothing but the end token follows it
                    raise ValueError(f"token {token} follows its guide's end")
                self.ended = True
            else:
                self._guide.advance(token, return_tokens=False)
            self.fed += 1
        bits = torch.zeros(words, dtype=torch.int32)
        if self.ended:
            bits[self._end // 32] = _bit(self._end % 32)
        else:
            self._guide.write_mask_into(bits.data_ptr(), bits.numel(), bits.element_size())
        return bits


def _bit(index: int) -> int:
    """Bit `index` (0..31) of an int32 word, as the word's value (bit 31: the sign)."""
    return -(2**31) if index == 31 else 1 << index


def allowed(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmasks (rows, words) int32 as booleans (rows, vocab): which tokens each row may
    choose (tokens past the masks' words: none)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = ((masks.unsqueeze(-1) >> shifts) & 1).bool().reshape(masks.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros((masks.shape[0], vocab - bits.shape[1]), dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def words_for(vocab: int) -> int:
    return (vocab + 31) // 32
