"""The device side: sampling, the compiled steps and the engine that drives them."""

from paxkv.engine.config import EngineConfig
from paxkv.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
