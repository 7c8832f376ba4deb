"""paxkv as a Tunix rollout engine: `PaxkvRollout`, a `tunix.rl.rollout.base_rollout.BaseRollout`.

    cluster_config = rl_cluster.ClusterConfig(
        rollout_engine=functools.partial(PaxkvRollout, num_pages=512, max_num_seqs=32),
        ...)

`RLCluster` builds it as it builds its own rollouts, from the trainer's actor
(`rollout_actor`, a Tunix Llama 3, Qwen2 or Qwen3 model: `paxkv.rl.tunix_models` maps
its config and leaves), the tokenizer, the rollout mesh and the `RolloutConfig`;
keyword arguments bound with `functools.partial` are `LLM.from_model`'s (`EngineConfig`
fields, `warmup`). The engine holds its own copy of the weights, so Tunix syncs them
after each step through `update_params` (in place, no recompilation, resharded from
the trainer's layout and cast to the engine's dtype). `generate` samples on paxkv's
paged engine, `get_per_token_logps` scores teacher-forced on it (no temperature, as
Tunix's own rollouts score).

Needs the `tunix` extra (`pip install -e '.[tunix]'`); imported only when used.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from paxkv.host.request import SamplingParams
from paxkv.models.registry import init_model
from paxkv.offline.llm import LLM
from paxkv.rl.tunix_models import family_of
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

# What the engine serves when `rollout_config` and the bound kwargs say nothing else.
DEFAULT_ENGINE = {"max_num_seqs": 64, "page_size": 16}


class PaxkvRollout(base_rollout.BaseRollout):
    """A Tunix rollout on paxkv's paged engine (module docstring).

    Args:
      rollout_actor: the trainer's actor model (Tunix Llama 3, Qwen2 or Qwen3); its
        weights are copied in, the actor is not held.
      tokenizer: Tunix's tokenizer (adapter): `encode`, `decode`, `pad_id()`, `eos_id()`,
        `bos_id()`.
      mesh: the rollout mesh; the engine runs tensor parallel over its devices (one
        device: that device).
      rollout_config: sets max_model_len (`kv_cache_size`, or the prompt length plus
        the tokens to generate) unless `max_model_len` is given.
      **llm_kwargs: `LLM.from_model`'s (`warmup`, `config`, `EngineConfig` fields);
        default warm-up "full": every step shape compiles before the first rollout.
    """

    def __init__(
        self,
        rollout_actor: nnx.Module,
        tokenizer: Any,
        mesh: jax.sharding.Mesh | None = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        **llm_kwargs: Any,
    ) -> None:
        self.family = family_of(rollout_actor)
        self._tokenizer = tokenizer
        self.mesh = mesh
        rc = rollout_config or base_rollout.RolloutConfig()
        max_len = llm_kwargs.pop("max_model_len", None) or max(
            int(rc.kv_cache_size), int(rc.max_prompt_length) + int(rc.max_tokens_to_generate)
        )
        leaves = _param_leaves(nnx.state(rollout_actor, nnx.Param))
        dtype = np.dtype(leaves[0][1].dtype)
        config = self.family.config(
            rollout_actor.config, dtype=dtype.name, max_position_embeddings=max_len
        )
        engine_mesh = _engine_mesh(mesh)
        model = init_model(config, mesh=engine_mesh)
        params = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(params, self._mapped(leaves, dtype))
        nnx.update(model, params)
        if "config" not in llm_kwargs:
            llm_kwargs = DEFAULT_ENGINE | {"max_model_len": max_len} | llm_kwargs
        llm_kwargs.setdefault("warmup", "full")
        self.llm = LLM.from_model(model, tokenizer=tokenizer, mesh=engine_mesh, **llm_kwargs)
        self._dtype = dtype
        self._calls = itertools.count()

    # BaseRollout.

    def generate(
        self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs: Any
    ) -> base_rollout.RolloutOutput:
        """Samples one completion per prompt. Prompts are tokenized as Tunix's own
        rollout does (BOS first when the tokenizer has one), the last `max_prompt_length`
        tokens kept; completions end at the first EOS (`eos_tokens`, else the
        tokenizer's), which they leave out. With `seed`, each prompt's sample is
        reproducible (seeded by the seed, the call and its index)."""
        rc = rollout_config
        width = int(rc.max_prompt_length)
        ids = [self._prompt_ids(p, width) for p in prompts]
        eos = tuple(int(t) for t in (rc.eos_tokens or [self.eos_id()]))
        call = next(self._calls)
        params = [
            SamplingParams(
                max_tokens=int(rc.max_tokens_to_generate),
                temperature=float(rc.temperature),
                top_p=float(rc.top_p),
                top_k=int(rc.top_k or 0),
                seed=None if rc.seed is None else _seed(rc.seed, call, i),
                stop_token_ids=eos,
                logprobs=0 if rc.return_logprobs else None,
            )
            for i in range(len(ids))
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            c = out.outputs[0]
            n = len(c.token_ids) - (1 if c.token_ids and c.token_ids[-1] in eos else 0)
            tokens.append(np.asarray(c.token_ids[:n], np.int32))
            if rc.return_logprobs:
                logprobs.append(np.asarray(c.token_logprobs[:n], np.float32))
        padded = np.full((len(ids), width), self.pad_id(), np.int32)
        for row, p in zip(padded, ids, strict=True):
            row[width - len(p) :] = p
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens],
            logits=[],
            tokens=tokens,
            left_padded_prompt_tokens=padded,
            logprobs=logprobs if rc.return_logprobs else None,
        )

    def get_per_token_logps(
        self, prompt_tokens: jax.Array, completion_tokens: jax.Array
    ) -> jax.Array:
        """f32[B, T]: each completion token's logprob given the prompt and the tokens
        before it, teacher-forced on the paged engine; prompt pads (left) and completion
        pads (right, `pad_id`) are left out, and padded positions get 0."""
        prompts = np.asarray(prompt_tokens)  # i32[B, P]
        completions = np.asarray(completion_tokens)  # i32[B, T]
        pad = self.pad_id()
        out = np.zeros(completions.shape, np.float32)
        rows, pairs = [], []
        for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            p = p[np.argmax(p != pad) :] if (p != pad).any() else p[:0]
            n = len(c) - int(np.argmax((c != pad)[::-1])) if (c != pad).any() else 0
            if n and len(p):
                rows.append(b)
                pairs.append((p.tolist(), c[:n].tolist()))
        if pairs:
            scores = self.llm.score([p for p, _ in pairs], [c for _, c in pairs])
            for b, s in zip(rows, scores, strict=True):
                out[b, : len(s)] = s
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Installs the trainer's parameters (`nnx.state(actor, filter_types)`) in place:
        mapped, cast to the engine's dtype, resharded into the engine's shardings, no
        recompilation. ValueError (the engine keeps its weights) for LoRA leaves or a
        tree that does not map."""
        if filter_types is not None and any(
            getattr(t, "__name__", "") == "LoRAParam" for t in filter_types
        ):
            raise ValueError(
                "update_params with LoRAParam leaves: paxkv takes whole weights; merge the "
                "adapters into the base weights before syncing"
            )
        self.llm.update_weights(self._mapped(_param_leaves(params), self._dtype))

    def pad_id(self) -> int:
        """The tokenizer's pad id."""
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        """The tokenizer's EOS id."""
        return int(self._tokenizer.eos_id())

    def model(self) -> nnx.Module:
        """The engine's model over the arrays it steps with (no copy; not the actor's, so
        Tunix syncs weights into it)."""
        runner = self.llm.engine.runner
        return nnx.merge(runner.target.graphdef, runner.params)

    # Helpers.

    def _prompt_ids(self, prompt: str, width: int) -> list[int]:
        ids = list(self._tokenizer.encode(prompt))
        bos = getattr(self._tokenizer, "bos_id", None)
        bos = bos() if callable(bos) else None
        if bos and (not ids or ids[0] != bos):
            ids.insert(0, int(bos))
        return [int(t) for t in ids[-width:]]

    def _mapped(self, leaves: Sequence[tuple[tuple, Any]], dtype: np.dtype) -> dict[str, Any]:
        tree = self.family.paxkv_tree(leaves)
        return jax.tree.map(lambda x: x if x.dtype == dtype else x.astype(dtype), tree)


def _param_leaves(state: Any) -> list[tuple[tuple, Any]]:
    """(path, array) of the `nnx.Param` leaves of an NNX state."""
    flat = nnx.to_flat_state(state)
    leaves = [(p, v.get_value()) for p, v in flat if isinstance(v, nnx.Variable)]
    if not leaves:
        raise ValueError("the actor's state holds no parameters")
    return leaves


def _seed(seed: Any, call: int, index: int) -> int:
    """A request's seed from Tunix's (an int or a PRNG key), the call and the index."""
    base = int(np.asarray(jax.random.key_data(seed) if _is_key(seed) else seed).ravel()[-1])
    return (base * 1_000_003 + call * 65_537 + index) % (2**63)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _engine_mesh(mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
    """paxkv's mesh over the rollout mesh's devices (tensor parallel over all of them);
    None for one device that is the default."""
    if mesh is None:
        return None
    devices = list(mesh.devices.flat)
    if len(devices) == 1 and devices[0] == jax.devices()[0]:
        return None
    return shardings.make_mesh(MeshShape(data=1, model=len(devices)), devices)
