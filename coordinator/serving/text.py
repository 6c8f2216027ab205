"""Text in, text out: the checkpoint's own tokenizer (`AutoTokenizer` from its directory), its
chat template, and decoding a stream of generated tokens as they come."""

from __future__ import annotations

from pathlib import Path

from offload.errors import CheckpointError, ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerError(CheckpointError):
    """No usable tokenizer or chat template; the message says what to do instead."""


def load_tokenizer(root: str | Path):
    """The tokenizer saved with the checkpoint. A checkpoint without one is an error that says
    token ids can still be passed from Python (`job.generate(input_ids)`)."""
    root = Path(root)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"{root} has no tokenizer ({', '.join(TOKENIZER_FILES)}): add the model's tokenizer "
            "files to the checkpoint directory, or pass token ids from Python "
            "(job.generate(input_ids))"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(root)
    except Exception as exc:  # transformers' own error types
        raise TokenizerError(f"{root}: cannot load its tokenizer: {exc}") from None


def prompt_ids(tokenizer, prompt: str | None = None, *, messages: list[dict] | None = None):
    """Token ids (1, n) of a plain prompt, or of chat `messages` through the tokenizer's chat
    template with the assistant's turn opened (`add_generation_prompt`)."""
    import torch

    if messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError(
                "this checkpoint's tokenizer has no chat template: send a plain prompt "
                "(/v1/completions, offloadctl generate without --chat)"
            )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise TokenizerError("the prompt is empty once tokenized")
    return torch.tensor([ids], dtype=torch.long)


def end_ids(tokenizer, index) -> tuple[int, ...]:
    """The token ids that end a sequence: the checkpoint's end-of-sequence ids (its
    generation_config.json, as generate takes them) and the tokenizer's."""
    from coordinator.engine import generation

    ids = set(generation.resolve(index.root, index.config, 1).eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


class TextStream:
    """Generated tokens of one sequence to text deltas, as they come. The whole sequence is
    decoded each time and only what is new is returned: a character split over several byte
    tokens appears once complete, never as a replacement character.

    `stop_strings` end the text where the first of them begins (it is not part of the text, as
    OpenAI's `stop` works); text that could still become the start of one is held back until
    the next tokens tell, so a stop string never reaches the client in part. `stopped` turns
    true at an end token or a stop string (`stop_string` says which)."""

    def __init__(
        self, tokenizer, stop_ids: tuple[int, ...] = (), stop_strings: tuple[str, ...] = ()
    ) -> None:
        if any(not s for s in stop_strings):
            raise ConfigError("a stop string must not be empty")
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.stop_strings = tuple(stop_strings)
        self.ids: list[int] = []
        self.text = ""  # handed out so far
        self.stopped = False
        self.stop_string: str | None = None

    def push(self, token_id: int) -> str:
        if self.stopped or token_id in self.stop_ids:
            self.stopped = True  # the end token and the padding after it are not text
            return ""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return ""
        return self._release(text, final=False)

    def finish(self) -> str:
        """What is left once the sequence has ended: bytes held back as an incomplete
        character, decoded as they are, and text held back for a stop string that did not
        come (the text then equals decoding every token at once, up to a stop string)."""
        if self.stop_string is not None:
            return ""
        return self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True), final=True)

    def _release(self, text: str, *, final: bool) -> str:
        found = [(text.find(s), s) for s in self.stop_strings if s in text]
        if found:
            end, self.stop_string = min(found)
            self.stopped = True
        elif final:
            end = len(text)
        else:  # hold back the longest end of the text that begins a stop string
            end = len(text) - max(
                (k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])),
                default=0,
            )
        delta = text[len(self.text) : end]
        self.text += delta
        return delta
