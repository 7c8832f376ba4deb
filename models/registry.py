"""Which model class runs which config, and models built from a config alone."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from paxkv.sharding import shardings

from .config import LlamaConfig, ModelConfig
from .gemma import GemmaForCausalLM
from .gemma_config import GemmaConfig
from .llama import LlamaForCausalLM

Model = LlamaForCausalLM | GemmaForCausalLM
MODEL_CLASSES: dict[type, type[Model]] = {
    LlamaConfig: LlamaForCausalLM,
    GemmaConfig: GemmaForCausalLM,
}


def model_class(config: ModelConfig) -> type[Model]:
    """The NNX model class of `config`'s family."""
    return MODEL_CLASSES[type(config)]


def init_model(config: ModelConfig, seed: int = 0, *, mesh: Any = None) -> Model:
    """A randomly initialised model (normal(0.02) weights, identity norms, zero biases).

    With a `mesh` (`paxkv.sharding`), the weights are initialised under `jit` directly
    in their shardings, so no device ever holds more than its shard; the values are the
    same as without one.
    """
    cls = model_class(config)
    if mesh is None:
        return cls(config, rngs=nnx.Rngs(seed))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(seed))))
    out = shardings.param_shardings(abstract, config, mesh)
    state = jax.jit(lambda: nnx.split(cls(config, rngs=nnx.Rngs(seed)))[1], out_shardings=out)()
    return nnx.merge(graphdef, state)
