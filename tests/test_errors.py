"""The error hierarchy: every error raised on purpose is a kind of OffloadCoordinatorError, kinds
map to HTTP statuses by type (never by message text), and each kind is still the builtin that
callers caught before."""

from __future__ import annotations

import pytest

from coordinator.engine import QueueFullError
from coordinator.engine.generation import GenerationError, KvBudget, KvNeverFitsError
from coordinator.runtime.errors import ClusterUnreachableError, WorkerLostError
from coordinator.runtime.inputs import InputError, check_inputs
from coordinator.runtime.registry import LoadNotFoundError
from coordinator.serving.app import BadRequest, status_of
from offload import errors
from worker.worker import WorkerError


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (QueueFullError("1024 sequence(s) already wait"), 429),
        (KvNeverFitsError("11 tokens per sequence exceed"), 400),
        (BadRequest("'n' must be int"), 400),
        (InputError("token id 500 is out of the vocabulary"), 400),
        (errors.CheckpointError("x"), 400),
        (errors.PlanError("x"), 400),
        (LoadNotFoundError("no load named 'x'"), 404),
        (WorkerLostError("a worker died"), 503),
        (WorkerError("stage 0: loading failed"), 503),
        (errors.OffloadError("wrap_modules was already called"), 500),  # misuse: our bug
        (ValueError("a library's own ValueError"), 500),  # not ours: a bug, not a 400
        (KeyError("x"), 500),
    ],
)
def test_the_status_comes_from_the_kind(exc: Exception, status: int) -> None:
    assert status_of(exc)[0] == status


def test_a_busy_message_without_the_words_is_still_busy() -> None:
    """The server used to look for "in flight" in the text; the kind decides now."""
    assert status_of(QueueFullError("come back later"))[0] == 429
    assert status_of(GenerationError("2 sequence(s), with 1 in flight"))[0] == 400


def test_never_fits_and_queue_full_are_apart() -> None:
    """Beyond the planned KV cache: never fits (400); a full queue: busy, retry (429)."""
    budget = KvBudget(max_batch=2, max_seq_len=10)
    with pytest.raises(KvNeverFitsError):
        budget.check(3, 5)
    assert issubclass(KvNeverFitsError, errors.NeverFitsError)
    assert issubclass(QueueFullError, errors.BusyError)
    assert not issubclass(QueueFullError, errors.NeverFitsError)


def test_kinds_are_still_the_builtins_callers_caught() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.NotFoundError, LookupError)
    assert issubclass(errors.LaunchError, RuntimeError)
    assert issubclass(ClusterUnreachableError, ConnectionError)
    assert issubclass(errors.PinningUnavailableError, errors.ConfigError)
    with pytest.raises(errors.ConfigError, match="out of the vocabulary"):
        import torch

        check_inputs(torch.tensor([[1, 500]]), None, 0, 128)


def test_offload_errors_import_nothing() -> None:
    """The leaf every layer imports: no import cycle can go through it."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(errors))
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert [getattr(n, "module", None) for n in imports] == ["__future__"]
