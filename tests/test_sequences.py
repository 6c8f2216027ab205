"""A request and its sequences as the engine and its clients see them
(`coordinator.engine.sequences`), driven directly: the settings a sequence sends the last
stage with its first step (which depend on the request and on whether it has generated yet,
as a preempted sequence has), its prompt's log-probabilities joined from their chunks, and
waiting on a request: a bounded wait that ends says how long it waited, an ended request
gives its rows or raises its error, and `on_finish` runs once it is done (its own exception
logged, never raised).

From mutation testing (issue 60): each test kills mutants no other test noticed (a setting
dropped or always sent, the chunks not joined, a bounded wait that waits forever).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from coordinator.engine.sequences import Finish, Request
from worker.steps import Logprobs, Sampling, SlotSettings

PENALISED = Sampling(repetition_penalty=1.3)  # its choice depends on the tokens before it


def test_a_sequence_s_settings_carry_its_request_s_choices() -> None:
    """A request with every choice set: end ids (sorted) because min_new_tokens bans them,
    both log-probability counts, the prompt to score and the history for its penalty; once it
    has generated (a preempted sequence admitted again) its prompt is not scored again and its
    history holds what it generated. A plain request sends none of them; a negative min_new_tokens is refused, naming it."""
    scored = Request.of(
        [[4, 8, 15, 16]],
        sampling=PENALISED,
        max_new_tokens=9,
        eos_token_ids=(7, 2),
        min_new_tokens=3,
        logprobs=2,
        prompt_logprobs=1,
    )
    [seq] = scored.sequences
    seq.seed = 42
    first = SlotSettings(
        sampling=PENALISED,
        seed=42,
        end_ids=(2, 7),
        prompt_length=4,
        min_tokens=3,
        logprobs=2,
        prompt_logprobs=1,
        prompt_ids=(4, 8, 15, 16),
        history=(4, 8, 15, 16),
    )
    assert seq.settings() == first
    seq.generated.extend([23, 42])  # the prompt is scored: its ids go no more
    assert seq.settings() == dataclasses.replace(
        first, prompt_logprobs=None, prompt_ids=(), history=(4, 8, 15, 16, 23, 42)
    )

    greedy = Sampling()
    [plain] = Request.of([[4, 8]], sampling=greedy, max_new_tokens=9, eos_token_ids=(7,)).sequences
    assert plain.settings() == SlotSettings(sampling=greedy, prompt_length=2)
    settings = plain.settings()
    assert (settings.end_ids, settings.prompt_ids, settings.history) == ((), (), ())
    assert settings.logprobs is None and settings.prompt_logprobs is None

    with pytest.raises(ValueError, match="min_new_tokens=-1 must be >= 0"):
        Request.of([[4, 8]], sampling=greedy, max_new_tokens=9, min_new_tokens=-1)


def chunk(start: int, tokens: list[int]) -> Logprobs:
    n = len(tokens)
    return Logprobs(
        start=start,
        token_ids=tuple(tokens),
        logprobs=tuple(-0.5 * (start + i) for i in range(n)),
        top_ids=tuple((t,) for t in tokens),
        top_logprobs=tuple((-0.5 * (start + i),) for i in range(n)),
    )


def test_the_prompt_s_logprobs_are_joined_once_every_chunk_came() -> None:
    """A 6-token prompt scored in chunks (positions 1-2, 3-4, 5): None until every chunk came,
    whatever order they came in, then one Logprobs of positions 1 to 5; a one-token prompt
    has nothing to score."""
    [seq] = Request.of(
        [[10, 11, 12, 13, 14, 15]], sampling=Sampling(), max_new_tokens=1, prompt_logprobs=1
    ).sequences
    assert seq.prompt_logprobs() is None
    seq.prompt_chunks[3] = chunk(3, [13, 14])
    seq.prompt_chunks[1] = chunk(1, [11, 12])
    assert seq.prompt_logprobs() is None  # position 5's chunk is missing
    seq.prompt_chunks[5] = chunk(5, [15])
    assert seq.prompt_logprobs() == chunk(1, [11, 12, 13, 14, 15])

    [short] = Request.of([[10]], sampling=Sampling(), max_new_tokens=1).sequences
    short.prompt_chunks[1] = chunk(1, [11])
    assert short.prompt_logprobs() is None


def test_waiting_on_a_request_until_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    """A wait bounded by a timeout returns at once when the request is not done (False, or a
    TimeoutError naming the timeout); once `end` wakes it, `result` gives each row's tokens,
    `on_finish` has run, seeing the request done, and its exception was logged, not raised.
    A request that ended with an error raises it."""
    seen = []

    def on_finish() -> None:
        seen.append(request.done())
        raise RuntimeError("the client's own failure")

    request = Request.of([[1, 2], [3]], sampling=Sampling(), max_new_tokens=2, on_finish=on_finish)
    request.id = 17
    assert not request.done() and request.wait(timeout=0) is False
    with pytest.raises(TimeoutError, match="within 0 s"):
        request.result(timeout=0)

    first, second = request.sequences
    first.generated.extend([5, 6])
    first.finish, second.finish = Finish.LENGTH, Finish.STOP
    second.generated.append(9)
    with caplog.at_level(logging.ERROR, logger="coordinator.engine.sequences"):
        request.end()
    assert seen == [True]
    assert "request 17" in caplog.text and "on_finish" in caplog.text
    assert request.done() and request.wait(timeout=0) is True
    assert request.result(timeout=0) == [[5, 6], [9]]
    assert request.finish_reasons == [Finish.LENGTH, Finish.STOP]

    failed = Request.of([[1]], sampling=Sampling(), max_new_tokens=2)
    failed.sequences[0].finish = Finish.ERROR
    failed.error = ValueError("the step failed")
    failed.end()
    with pytest.raises(ValueError, match="the step failed"):
        failed.result()
