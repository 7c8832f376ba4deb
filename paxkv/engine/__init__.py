"""The device side: cache state, sampling, the compiled steps and the engine that drives them."""

from paxkv.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
