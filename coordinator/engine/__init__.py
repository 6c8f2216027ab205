"""The generation engine: one step loop for every request in flight (see engine.py)."""

from coordinator.engine.engine import Engine, EngineClosedError, EngineConfig, QueueFullError
from coordinator.engine.sequences import Finish, Request

__all__ = ["Engine", "EngineClosedError", "EngineConfig", "Finish", "QueueFullError", "Request"]
