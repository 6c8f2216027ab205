"""A completion request of the HTTP front (serving/app.py) in its job's engine: its `n` rows
(choices), each row's text as it comes, and the log-probabilities the request asked for."""

import asyncio
import functools
import logging
import threading
from dataclasses import dataclass, field

from fastapi import Request

logger = logging.getLogger(__name__)
_NOTHING = object()
DISCONNECT_POLL_S = 1.0  # a streamed request waiting in the queue checks its client this often
FLOOR_LOGPROB = -9999.0  # what -inf becomes in JSON (vLLM's value: JSON has no infinity)


@dataclass(frozen=True, slots=True)
class TokenScore:
    """One token of a choice, as the responses' `logprobs` show it: its text (the token decoded
    alone), its log-probability (None: the first prompt token, which nothing scores) and the
    most likely tokens there, (text, id, log-probability), most likely first."""

    token_id: int
    text: str
    logprob: float | None
    top: tuple[tuple[str, int, float], ...] | None


@dataclass(frozen=True, slots=True)
class Delta:
    """What a row's next token adds: text (maybe "", bytes held back) and its scores."""

    row: int
    text: str
    scores: tuple[TokenScore, ...] = ()
    first: bool = False  # the request's first token: a streamed response starts with it
    new_tokens: int = 0  # the request's completion tokens with this one (a chunk's usage)


@dataclass
class Choice:
    """One row of the request: its text stream, what it counted, how it ended."""

    stream: object  # coordinator.serving.text.TextStream
    new_tokens: int = 0
    finish_reason: str = "length"
    # vLLM's: the stop string, or the stop_token_ids token, that ended it (None: an end
    # token of the model, or its length)
    stop_reason: str | int | None = None
    scores: list[TokenScore] = field(default_factory=list)  # of its tokens, when asked


class Run:
    """One request in the load's engine, its rows' text deltas handed to the event loop (the
    engine client's fetch thread calls back and detokenises; no thread per request). Waiting
    in the engine's queue costs nothing here: the client gets its first byte with the first
    token. `logprobs` (how many top tokens, None: none) scores every generated token;
    `echo_logprobs` (the same count) scores the prompt too (`prompt_scores`), position 0
    unscored, as OpenAI's and vLLM's echo does. `score_only` (vLLM's max_tokens 0 with
    echo): the prompt goes through for its scores, and its one token is not handed out.
    `stop_token_ids`: the request's own end tokens, which a choice's `stop_reason` names."""

    def __init__(
        self,
        job,
        tokenizer,
        ids,
        options: dict,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        *,
        n: int = 1,
        skip_special_tokens: bool = True,
        logprobs: int | None = None,
        echo_logprobs: int | None = None,
        score_only: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ) -> None:
        from coordinator.serving.text import TextStream, end_ids

        self.job, self.tokenizer, self.ids = job, tokenizer, ids
        self.options = {**options, "logprobs": logprobs, "prompt_logprobs": echo_logprobs}
        ends = options.get("eos_token_id")  # given (ignore_eos, stop_token_ids): the engine's
        ends = end_ids(tokenizer, job.index) if ends is None else tuple(ends)
        self.choices = [
            Choice(
                TextStream(
                    tokenizer,
                    ends,
                    stop,
                    include_stop=include_stop,
                    min_tokens=options.get("min_new_tokens") or 0,
                    skip_special_tokens=skip_special_tokens,
                )
            )
            for _ in range(n)
        ]
        self.logprobs = logprobs
        self.score_only, self.stop_token_ids = score_only, frozenset(stop_token_ids)
        self.prompt_scores: list[TokenScore] = []  # echo with logprobs: the prompt's
        self.error: Exception | None = None
        self._pending: dict[int, list] = {}  # row -> Logprobs of the token about to come
        self._first_sent = False
        self._request = None
        self._submitting = threading.Lock()  # the submit's thread against an abandoning client
        self._abandoned = False
        self._first = _NOTHING  # an item `started` took from the queue
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Queue the request (raises what the engine refuses: a full queue is a BusyError).
        The submit is a call to the load's engine (through Ray for a named load): it runs on
        a thread, so the event loop serves the replica's other streams meanwhile."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        wants_scores = self.options["logprobs"] is not None
        wants_scores |= self.options["prompt_logprobs"] is not None
        submit = functools.partial(
            self.job.submit,
            self.ids.repeat(len(self.choices), 1),  # n rows, each its own seed (seed + row)
            on_token=self._on_token,
            on_finish=lambda: self._put(None),
            on_logprobs=self._on_logprobs if wants_scores else None,
            **self.options,
        )
        try:
            await asyncio.to_thread(self._submit, submit)
        except asyncio.CancelledError:  # the client went away while the submit was in flight
            with self._submitting:
                self._abandoned = True  # a submit still running cancels what it queues
            self.cancel()  # one that has returned: its request is known
            raise

    def _submit(self, submit) -> None:
        """The submit, on its thread: its request is this run's, or is cancelled at once when
        the run was abandoned meanwhile (nobody would read it; it would hold its KV blocks and
        run to its limit)."""
        request = submit()
        with self._submitting:
            self._request, abandoned = request, self._abandoned
        if abandoned:
            _cancel(self.job, request)

    async def finish(self) -> None:
        await self.start()
        try:
            async for _ in self.deltas():
                pass
        except BaseException:  # cancelled (its client went away): the request ends too
            self.cancel()
            raise
        if self.error is not None:
            raise self.error

    async def started(self, request: Request) -> bool:
        """Wait until the request has its first token (or has ended): it waited its turn in
        the engine's queue until then. False when the client went away meanwhile (the request
        is then cancelled; so it is when this wait is)."""
        try:
            while True:
                try:
                    self._first = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
                    return True
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.cancel()
                        return False
        except BaseException:
            self.cancel()
            raise

    def first_count(self) -> int | None:
        """The completion tokens with the first delta `started` took (None: none yet)."""
        return self._first.new_tokens if isinstance(self._first, Delta) else None

    async def deltas(self):
        """Each `Delta` as it comes; at the end, what each row held back (its text then ends
        as decoding all its tokens at once does)."""
        first, self._first = self._first, _NOTHING
        while True:
            delta = first if first is not _NOTHING else await self._queue.get()
            first = _NOTHING
            if delta is None:
                for rest in self._end():
                    yield rest
                return
            yield delta

    def cancel(self) -> None:
        """End the request at the engine's next step. A call to the engine: from the event
        loop it is handed to a thread (the loop never waits on Ray), from the engine client's
        fetch thread it is made there."""
        request = self._request
        if request is None or request.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop
            _cancel(self.job, request)
            return
        loop.run_in_executor(None, _cancel, self.job, request)  # never raises: not awaited

    def _put(self, item) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _on_logprobs(self, row: int, scores) -> None:
        if scores.start < self.ids.shape[1]:  # the prompt's (every row's are the same)
            if row == 0:
                self.prompt_scores = self._scored(self.ids[0, 0:1].tolist(), None) + (
                    self._scored(list(scores.token_ids), scores)
                )
            return
        self._pending.setdefault(row, []).append(scores)

    def _on_token(self, row: int, token: int) -> None:
        choice = self.choices[row]
        pending = self._pending.pop(row, [])
        if self.score_only:  # its one token is not the client's
            if not self._first_sent:
                self._first_sent = True
                self._put(Delta(row, "", (), True, 0))
            return
        stopped = choice.stream.stopped
        delta = choice.stream.push(token)
        scores = ()
        if not stopped:
            choice.new_tokens += 1
            if pending:
                scores = tuple(self._scored([token], pending[-1]))
                choice.scores.extend(scores)
        if choice.stream.stopped and not stopped:
            choice.finish_reason = "stop"
            string = choice.stream.stop_string
            choice.stop_reason = string if string is not None else _own(token, self.stop_token_ids)
            if all(c.stream.stopped for c in self.choices):
                self.cancel()  # every row stopped (a stop string: the engine saw no end)
        first = not self._first_sent
        self._first_sent = True
        if delta or scores or first:  # the first token always: the response starts with it
            count = sum(c.new_tokens for c in self.choices)
            self._put(Delta(row, delta, scores, first, count))

    def _scored(self, token_ids: list[int], scores) -> list[TokenScore]:
        """`TokenScore`s of `token_ids` from their `Logprobs` (None: unscored)."""
        text = self._token_text
        if scores is None:
            return [TokenScore(t, text(t), None, None) for t in token_ids]
        return [
            TokenScore(
                t,
                text(t),
                _finite(scores.logprobs[i]),
                tuple(
                    (text(top_id), top_id, _finite(value))
                    for top_id, value in zip(scores.top_ids[i], scores.top_logprobs[i], strict=True)
                ),
            )
            for i, t in enumerate(token_ids)
        ]

    def _token_text(self, token_id: int) -> str:
        """A token as `logprobs` names it: decoded alone, special tokens included (vLLM's)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _end(self) -> list[Delta]:
        """The request is over: keep its error, or the text each row held back (an incomplete
        character, a stop string that did not come)."""
        error = self._request.error
        if error is not None and not isinstance(error, Exception):
            error = RuntimeError(str(error))
        self.error = error
        if error is not None:
            return []
        rests = [(row, c.stream.finish()) for row, c in enumerate(self.choices)]
        return [Delta(row, rest) for row, rest in rests if rest]

    @property
    def text(self) -> str:
        """Row 0's text handed out so far."""
        return self.choices[0].stream.text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    def usage(self, new_tokens: int | None = None) -> dict:
        """The request's usage: its completion tokens so far, or `new_tokens` (those up to a
        delta: a streamed chunk's usage is that of the tokens it carries)."""
        prompt = int(self.ids.shape[1])
        new = sum(c.new_tokens for c in self.choices) if new_tokens is None else new_tokens
        return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


def _cancel(job, request) -> None:
    try:
        job.engine().cancel(request)
    except Exception as exc:  # the engine is gone: nothing of the request is left to free
        logger.warning("cancel not delivered: %s", exc)


def _own(token: int, stop_token_ids: frozenset[int]) -> int | None:
    """The stop reason of an end token: itself when the request asked for it, None when it is
    the model's own (as vLLM's stop_reason)."""
    return token if token in stop_token_ids else None


def _finite(value: float) -> float:
    return value if value > FLOOR_LOGPROB else FLOOR_LOGPROB
