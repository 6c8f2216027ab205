"""Text in, text out: the checkpoint's own tokenizer (`AutoTokenizer` from its directory), its
chat template, and decoding a stream of generated tokens as they come."""

from __future__ import annotations

from pathlib import Path

from offload.errors import CheckpointError, ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerError(CheckpointError):
    """No usable tokenizer or chat template, or messages the template cannot render; the
    message says what to do instead (`param`: the request field at fault, if any)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


def prompt_ids(
    tokenizer,
    prompt: str | None = None,
    *,
    messages: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
):
    """Token ids (1, n) of a plain prompt, or of chat `messages` through the tokenizer's chat
    template (or `chat_template`), the assistant's turn opened unless `add_generation_prompt`
    is False, the last message left open with `continue_final_message` (its text goes on),
    `template_kwargs` the template's own variables (`enable_thinking`, say)."""
    import torch

    if messages is not None:
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise TokenizerError(
                "this checkpoint's tokenizer has no chat template: send a plain prompt "
                "(/v1/completions, offloadctl generate without --chat)"
            )
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(template_kwargs or {}),
            )
        # The template's own refusal (raise_exception: "roles must alternate", say), or its
        # code meeting values it cannot take: the messages' fault, a 400 naming them.
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TokenizerError(
                f"the chat template cannot render these messages: {exc}", param="messages"
            ) from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise TokenizerError("the prompt is empty once tokenized")
    return torch.tensor([ids], dtype=torch.long)


def template_reads_parts(tokenizer, template: str | None = None) -> bool:
    """Whether a chat template (`template`, else the tokenizer's) takes a message's content as
    a list of parts ({"type": "text", "text": ...}, as transformers passes them): decided from
    the template's syntax tree, as vLLM's "auto" content format does. It reads parts when it
    loops over a message's content (`{% for part in message['content'] %}`, directly, through
    a filter, or through a variable set from it); otherwise it takes a string, and parts are
    joined into one first. A test such as `message.content is string` is no loop: a template
    that keeps content only when it is a string (Qwen3's) must get strings, or it sees ''."""
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
    if not isinstance(template, str):
        return False
    import jinja2
    from jinja2 import nodes

    try:
        root = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # rendering will say what is wrong with it
    # the names a message is bound to: loop targets over `messages` (or a slice, a filter of
    # it, or a variable set from it), and what a template sets from those
    listed = {"messages"} | _names_set_from(root, lambda n: _refers(n, {"messages"}))
    message = {
        loop.target.name
        for loop in root.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and _refers(loop.iter, listed)
    }
    message |= {"message", "msg"}
    content = lambda n: _is_content(n, message)  # noqa: E731
    names = _names_set_from(root, content)
    return any(
        content(_unwrapped(loop.iter))
        or (isinstance(_unwrapped(loop.iter), nodes.Name) and _unwrapped(loop.iter).name in names)
        for loop in root.find_all(nodes.For)
    )


def _unwrapped(node):
    """What a filter chain applies to (`message.content | selectattr(...)` -> the content)."""
    from jinja2 import nodes

    while isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
        node = node.node
    return node


def _refers(node, names: set[str]) -> bool:
    """`node` is one of `names`, or a slice, item or filter of one."""
    from jinja2 import nodes

    node = _unwrapped(node)
    while isinstance(node, nodes.Getitem | nodes.Getattr):
        node = node.node
    return isinstance(node, nodes.Name) and node.name in names


def _is_content(node, message: set[str]) -> bool:
    """`node` is `m.content` or `m['content']` of a message name `m`."""
    from jinja2 import nodes

    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr):
        key = node.attr
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        key = node.arg.value
    else:
        return False
    return key == "content" and isinstance(node.node, nodes.Name) and node.node.name in message


def _names_set_from(root, matches) -> set[str]:
    """Names a template sets (`{% set x = ... %}`) to a value `matches` accepts."""
    from jinja2 import nodes

    return {
        n.target.name
        for n in root.find_all(nodes.Assign)
        if isinstance(n.target, nodes.Name) and matches(n.node)
    }


def end_ids(tokenizer, index) -> tuple[int, ...]:
    """The token ids that end a sequence: the checkpoint's end-of-sequence ids (its
    generation_config.json, as generate takes them) and the tokenizer's."""
    from coordinator.engine import generation

    ids = set(generation.resolve(index.root, index.config, 1, style="vllm").eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


# A character is at most 4 UTF-8 bytes, so one split over byte tokens is whole within 4 tokens,
# and bytes that cannot complete one are released at the next token (`_detokenize`). Tokens
# that still give no text after this many (ones that decode to nothing) are released at a
# clean cut so that the decoded window, and so the cost of a token, stays bounded.
MAX_PENDING = 8


class TextStream:
    """Generated tokens of one sequence to text deltas, as they come, at a cost per token that
    does not grow with the sequence: incremental detokenizing as vLLM's and
    text-generation-inference's do. Only a short window of recent ids is decoded, a prefix (the
    tokens handed out last) and the pending tokens after it; what the window decodes to past
    the prefix's text is new. The prefix gives the new tokens their context (a sentencepiece
    "▁" decodes as a space only after other text). A character split over several byte tokens
    appears once complete, never as a replacement character; bytes that cannot complete one
    appear as U+FFFD at the next token, so at most one incomplete character is ever held
    back (and a stop string's possible start). Deltas plus `finish()` add up to
    decoding every token at once (with `skip_special_tokens` as given: by default special
    tokens are not text), up to a stop string.

    `stop_strings` end the text where the first of them begins (it is not part of the text, as
    OpenAI's `stop` works; with `include_stop` they end it after it, as vLLM's
    include_stop_str_in_output, which also keeps a stop token's text); text that could still become the start of one is held back until
    the next tokens tell, so a stop string never reaches the client in part. `stopped` turns
    true at an end token or a stop string (`stop_string` says which). Text handed out never
    holds the start of a stop string, so only the held-back text and the new delta are
    searched."""

    def __init__(
        self,
        tokenizer,
        stop_ids: tuple[int, ...] = (),
        stop_strings: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ConfigError("a stop string must not be empty")
        # vLLM's min_tokens: the text of the first min_tokens tokens is never searched for a
        # stop string (their end tokens the engine masks)
        self.min_tokens = min_tokens
        self._pushed = 0
        self.skip_special_tokens = skip_special_tokens
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.stop_strings = tuple(stop_strings)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.stopped = False
        self.stop_string: str | None = None
        # The decoded window: _window[:_read] is the prefix, already handed out (its text is
        # _prefix_text), _window[_read:] the tokens whose text is still pending.
        self._window: list[int] = []
        self._read = 0
        self._prefix_text = ""
        self._held = ""  # decoded but held back: it may begin a stop string
        self._out: list[str] = []  # the deltas handed out; `text` joins them when read
        # Special tokens decode to nothing (skip_special_tokens): they stay out of the window,
        # or a run of them would widen it. Only ids the tokenizer really skips (checked once,
        # on first sight) count.
        self._specials = frozenset(getattr(tokenizer, "all_special_ids", ())) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        if not skip_special_tokens:  # they are text: in the window like any token
            self._specials = frozenset()
        self._skipped: dict[int, bool] = {}
        self._probe: list[int] | None = None  # continuation-byte tokens (`_split`), on need

    @property
    def text(self) -> str:
        """The text handed out so far (joined when read, not per token)."""
        if len(self._out) > 1:
            self._out[:] = ["".join(self._out)]
        return self._out[0] if self._out else ""

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""  # the padding after the end is not text
        self._pushed += 1
        if token_id in self.stop_ids:
            self.stopped = True  # the end token is not text, unless include_stop
            if not self.include_stop:
                return ""
        if token_id in self._specials and self._skips(token_id):
            return ""
        self._window.append(token_id)
        return self._release(self._detokenize(), final=False)

    def finish(self) -> str:
        """What is left once the sequence has ended: bytes held back as an incomplete
        character, decoded as they are, and text held back for a stop string that did not
        come (the text then equals decoding every token at once, up to a stop string)."""
        if self.stop_string is not None:
            return ""
        new = self._decode(self._window)[len(self._prefix_text) :]
        self._window.clear()  # all is handed out: a second finish releases nothing
        self._read, self._prefix_text = 0, ""
        return self._release(new, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _skips(self, token_id: int) -> bool:
        if token_id not in self._skipped:
            self._skipped[token_id] = self._decode([token_id]) == ""
        return self._skipped[token_id]

    def _detokenize(self) -> str:
        """The new text the window gives with its last token. Only the bytes of one character
        that may still complete (the text ends in a replacement character) are held back:
        whatever comes before it is handed out, replacement characters of bytes that the next
        token showed can never complete included (as `tokenizers`' decode stream and vLLM do)."""
        text = self._decode(self._window)
        if len(text) > len(self._prefix_text) and not text.endswith("\ufffd"):
            return self._advance(text)
        if text.endswith("\ufffd") and len(self._window) - self._read > 1:
            head = self._split(text, proven=True)  # what comes before the last character
            if head is not None:
                return head
        if len(self._window) - self._read < MAX_PENDING:
            return ""  # an incomplete character, or nothing new yet: the next tokens tell
        return self._cut(text)

    def _advance(self, text: str) -> str:
        """Hand out the window's text (`text`) past the prefix's; the tokens just handed out
        become the next prefix, the context of the tokens to come."""
        delta = text[len(self._prefix_text) :]
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window[: self._read])
        return delta

    def _split(self, text: str, *, proven: bool) -> str | None:
        """Hand out the text up to the last token boundary after which the pending tokens
        decode as they do on their own, when that releases something; the window keeps the
        tokens after it. `proven`: only where continuation bytes after the window would not
        change that text either (so nothing later can), which needs the tokenizer's byte
        tokens (`_continuations`). None when there is no such boundary."""
        if proven:
            if self._probe is None:
                self._probe = _continuations(self.tokenizer)
            if not self._probe:
                return None
        for cut in range(len(self._window) - 1, self._read, -1):
            head = self._decode(self._window[:cut])
            if len(head) < len(self._prefix_text) + proven:
                continue
            if head + self._decode(self._window[cut:]) != text:
                continue
            # Lossy decoders may give an incomplete character one U+FFFD per byte
            # (sentencepiece's byte fallback), so head + tail == text although more bytes
            # complete it later: the probe's continuation bytes tell.
            if proven and not self._decode(self._window + self._probe).startswith(head):
                continue
            delta = head[len(self._prefix_text) :]
            del self._window[:cut]
            self._read, self._prefix_text = 0, ""
            return delta
        return None

    def _cut(self, text: str) -> str:
        """MAX_PENDING tokens and still no complete text: invalid bytes a tokenizer without
        byte tokens decodes, or tokens that decode to nothing. Hand out the text up to the last
        clean token boundary (`_split`); otherwise (byte runs a tokenizer can only decode
        whole, say) release the window as decoded: the text may then differ from decoding all
        at once, but the window cannot widen without bound."""
        head = self._split(text, proven=False)
        return head if head is not None else self._advance(text)

    def _release(self, new: str, *, final: bool) -> str:
        if not new and not final:
            return ""
        pending = self._held + new  # the only text a stop string can begin in
        if self._pushed <= self.min_tokens:
            self._held = ""  # before min_tokens: no stop string, nothing held for one
            if pending:
                self._out.append(pending)
            return pending
        found = _first_stop(pending, self.stop_strings)
        if found is not None:
            end, self.stop_string = found
            end += len(self.stop_string) if self.include_stop else 0
            self.stopped = True
        elif final:
            end = len(pending)
        else:  # hold back the longest end of the text that begins a stop string
            end = len(pending) - _stop_start(pending, self.stop_strings)
        delta, self._held = pending[:end], pending[end:]
        if delta:
            self._out.append(delta)
        return delta


def byte_level_char(byte: int) -> str:
    """The character GPT-2's byte-level BPE writes `byte` as in its tokens (its
    bytes_to_unicode: printable Latin-1 bytes as themselves, the others from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def _continuations(tokenizer) -> list[int]:
    """Three tokens of the byte 0x80 (a UTF-8 continuation byte), enough to complete any
    incomplete character, when the tokenizer has byte tokens that it decodes as
    `String::from_utf8_lossy` does (byte-level BPE: one U+FFFD per invalid sequence, the
    bytes around it decoded as they are, so bytes appended never change a character before
    an incomplete one); else [] (never probed). Sentencepiece's byte fallback turns a whole
    run of byte tokens into one U+FFFD per byte unless the run is valid UTF-8, so bytes
    appended can change what comes before: it is not probed."""
    for lead, cont in (("<0xE2>", "<0x80>"), (byte_level_char(0xE2), byte_level_char(0x80))):
        ids = tokenizer.convert_tokens_to_ids([lead, cont])
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            continue
        if tokenizer.decode([ids[0], ids[1], ids[1], ids[1]]) == "\u2000\ufffd":  # E2 80 80 80
            return [ids[1]] * 3
    return []


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> tuple[int, str] | None:
    """(where, which) of the stop string that begins first in `text`, if any."""
    return min(((text.find(s), s) for s in stop_strings if s in text), default=None)


def _stop_start(text: str, stop_strings: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of a stop string."""
    return max(
        (
            k
            for s in stop_strings
            for k in range(1, min(len(s), len(text) + 1))
            if text.endswith(s[:k])
        ),
        default=0,
    )
