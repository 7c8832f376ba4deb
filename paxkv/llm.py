"""The offline Python API, compatible with vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from paxkv.engine import Engine, EngineConfig
from paxkv.request import RequestOutput, SamplingParams


class LLM:
    """Loads a model and serves batches of prompts through the paged engine.

        llm = LLM(model="tiny", num_pages=512, page_size=16, max_num_seqs=32)
        outputs = llm.generate(["def f(x):"], SamplingParams(max_tokens=32))
        outputs[0].outputs[0].text

    Args:
      model: a preset name of `paxkv.models` (e.g. "tiny"), or a local Hugging Face
        checkpoint directory (config.json + safetensors). Nothing is downloaded.
      dtype: parameter dtype ("float32", "bfloat16"); None keeps the model's.
      seed: seed of random initialisation (presets), and with `config=None` of requests
        without a seed (a given `config` carries its own).
      mesh: a `jax.sharding.Mesh` of one replica to shard the model and cache over
        (see `paxkv.sharding.shardings`); None serves on one device.
      config: the engine's `EngineConfig`; None: its defaults, with `seed` and
        max_model_len = min(the model's positions, 2048).
      **engine_kwargs: `EngineConfig` fields that override `config`'s: num_pages,
        page_size, max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_dtype,
        attention_backend, ...
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str | None = None,
        seed: int = 0,
        mesh: Any = None,
        config: EngineConfig | None = None,
        **engine_kwargs: Any,
    ) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise TypeError(
                f"LLM() got unknown arguments {unknown}; engine options are {sorted(known)}"
            )
        # The one place paxkv reaches up to the models package, lazily: it turns a name
        # into a model. `Engine` takes a model object and needs no such import.
        models = importlib.import_module("paxkv.models")
        model_config, module, tokenizer = models.load_model(model, dtype=dtype, seed=seed)
        if config is None:
            max_len = min(model_config.max_position_embeddings, 2048)
            config = EngineConfig(seed=seed, max_model_len=max_len)
        config = dataclasses.replace(config, **engine_kwargs)
        self.engine = Engine(module, config, tokenizer=tokenizer, mesh=mesh)
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None when it has none)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions of every prompt; returns them in the prompts' order.

        A prompt is a string (needs a tokenizer) or `{"prompt_token_ids": [...]}`.
        `sampling_params` is one for all prompts or one per prompt. Every prompt is
        validated before any runs: a bad one raises ValueError naming its index, and
        nothing is submitted.
        """
        ids = self._submit(prompts, sampling_params)
        final = self.engine.run_until_done()
        return [final[i] for i in ids]

    def generate_stream(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields each request's output every time it advances.

        Each yielded output holds the completion so far; the last one for a request has
        `finished=True`. Closing the iterator early aborts the requests still running.
        """
        ids = self._submit(prompts, sampling_params)
        pending = set(ids)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            for rid in pending:
                self.engine.abort(rid)
            if pending:
                self.engine.step()  # reports, and so forgets, the aborted requests

    def stats(self) -> dict[str, Any]:
        """The engine's counters (see `Engine.stats`)."""
        return self.engine.stats()

    def _submit(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        ids = [str(next(self._request_ids)) for _ in prompts]
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
            try:
                self.engine.requests.validate(rid, prompt, p)
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.engine.add_request(rid, prompt, p)
        return ids
