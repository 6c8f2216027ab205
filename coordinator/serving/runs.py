"""A completion request of the HTTP front (serving/app.py) in its job's engine."""

import asyncio

from fastapi import Request

_NOTHING = object()
DISCONNECT_POLL_S = 1.0  # a streamed request waiting in the queue checks its client this often


class Run:
    """One request in the load's engine, its text deltas handed to the event loop (the engine
    client's fetch thread calls back and detokenises; no thread per request). Waiting in the engine's queue costs nothing
    here: the client gets its first byte with the first token."""

    def __init__(
        self,
        job,
        tokenizer,
        ids,
        options: dict,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
    ) -> None:
        from coordinator.serving.text import TextStream, end_ids

        self.job, self.ids, self.options = job, ids, options
        ends = options.get("eos_token_id")  # given (ignore_eos, stop_token_ids): the engine's
        ends = end_ids(tokenizer, job.index) if ends is None else tuple(ends)
        self.stream = TextStream(
            tokenizer,
            ends,
            stop,
            include_stop=include_stop,
            min_tokens=options.get("min_new_tokens") or 0,
        )
        self.error: Exception | None = None
        self.new_tokens = 0
        self.finish_reason = "length"
        self._request = None
        self._first = _NOTHING  # an item `started` took from the queue
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Queue the request (raises what the engine refuses: a full queue is a BusyError)."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._request = self.job.submit(
            self.ids, on_token=self._on_token, on_finish=lambda: self._put(None), **self.options
        )

    async def finish(self) -> None:
        self.start()
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

    async def deltas(self):
        first, self._first = self._first, _NOTHING
        while True:
            delta = first if first is not _NOTHING else await self._queue.get()
            first = _NOTHING
            if delta is None:
                rest = self._end()
                if rest:
                    yield rest
                return
            yield delta

    def cancel(self) -> None:
        if self._request is not None and not self._request.done():
            self.job.engine().cancel(self._request)

    def _put(self, item) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _on_token(self, row: int, token: int) -> None:
        if not self.stream.stopped:
            self.new_tokens += 1
        delta = self.stream.push(token)
        if self.stream.stopped:
            self.finish_reason = "stop"
            if self.stream.stop_string is not None:  # the engine has no end token to see
                self.cancel()
        if delta:
            self._put(delta)

    def _end(self) -> str:
        """The request is over: keep its error, or return the text held back (an incomplete
        character, a stop string that did not come)."""
        error = self._request.error
        if error is not None and not isinstance(error, Exception):
            error = RuntimeError(str(error))
        self.error = error
        if error is not None:
            return ""
        return self.stream.finish()

    @property
    def text(self) -> str:
        """The text handed out so far (its stream joins it when read, not per token)."""
        return self.stream.text

    def usage(self) -> dict:
        prompt = int(self.ids.shape[1])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.new_tokens,
            "total_tokens": prompt + self.new_tokens,
        }
