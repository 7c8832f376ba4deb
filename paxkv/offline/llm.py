"""The offline Python API, compatible with vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from flax import nnx
from tqdm import tqdm

from paxkv import models
from paxkv.engine import Engine, EngineConfig, compile_cache
from paxkv.host.lora_slots import LoRARequest
from paxkv.host.request import (
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    check_float,
    check_token_ids,
)
from paxkv.offline.call_mailboxes import CallMailboxes
from paxkv.offline.progress import logging_above_bars
from paxkv.sharding import shardings
from paxkv.text import chat as chat_templates

Prompts = str | dict | Sequence[str | dict]
Params = SamplingParams | Sequence[SamplingParams] | None
# A progress bar switch, as vLLM takes it: True, False, or a tqdm-like class to make it with.
UseTqdm = bool | Callable[..., Any]


# `LLM(warmup=...)`: True is "background".
WARMUP_MODES = (True, False, "background", "full")


def default_engine_config(model_config: Any, seed: int = 0) -> EngineConfig:
    """The engine limits a model is served with when none are given: `EngineConfig`'s
    defaults, with `seed` and max_model_len = min(the model's positions,
    `EngineConfig.max_model_len`)."""
    max_len = min(model_config.max_position_embeddings, EngineConfig.max_model_len)
    return EngineConfig(seed=seed, max_model_len=max_len)


class LLM:
    """Loads a model and serves batches of prompts through the paged engine.

        llm = LLM(model="tiny", num_pages=512, page_size=16, max_num_seqs=32)
        outputs = llm.generate(["def f(x):"], SamplingParams(max_tokens=32))
        outputs[0].outputs[0].text
        llm.chat([{"role": "user", "content": "Hi"}])  # a checkpoint with a chat template

    Args:
      model: a preset name of `paxkv.models` (e.g. "tiny"), or a local Hugging Face
        checkpoint directory (config.json + safetensors). Nothing is downloaded.
      dtype: parameter dtype ("float32", "bfloat16"); None keeps the model's.
      scan_layers: hold the layers stacked and run them as one scan, so each step
        shape compiles one layer rather than all of them (deep models); None: off.
      quantization: "int8" or "fp8" quantizes the projections' and experts' weights at
        load, a scale per output channel (`paxkv.models.quantized_weights`; the
        quantization extra); None: the model dtype.
      seed: seed of random initialisation (presets), and with `config=None` of requests
        without a seed (a given `config` carries its own).
      mesh: a `jax.sharding.Mesh` of one replica to shard the model and cache over
        (see `paxkv.sharding.shardings`); None serves on one device.
      config: the engine's `EngineConfig`; None: its defaults, with `seed` and
        max_model_len = min(the model's positions, `EngineConfig.max_model_len`).
        These are not the launch apps' defaults: `paxkv-serve` and the others serve
        their `--setup` set-up's limits (`paxkv.launch.setups`; tiny-py's are small, for a
        quick warm-up on the CPU); `config=paxkv.launch.setups.get_setup(name).engine`
        serves with those.
      warmup: True or "background" (the default): compile the largest step shape's
        programs now, with a progress bar on stderr, and the others in a background
        thread while requests run (each step on the smallest compiled shape that holds
        it); "full": every program before returning, so no request waits for one later
        (benchmarks); False: none, each compiled when a step first needs it (tests,
        one-shot scripts). See `Engine.warmup`.
      cache_dir: the persistent compilation cache's directory, where a later start
        loads the compiled programs (`paxkv.engine.compile_cache`); None: this
        process's, by default `$PAXKV_CACHE_DIR` or `~/.cache/paxkv`; "off": none.
      pause_timeout_s: how long a running `generate` or stream waits while the engine
        is paused (`engine.pause()`, from another thread) before it raises
        TimeoutError; None: until `engine.resume()`. It waits without using the CPU.
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
        scan_layers: bool | None = None,
        quantization: str | None = None,
        config: EngineConfig | None = None,
        warmup: bool | str = True,
        cache_dir: str | None = None,
        pause_timeout_s: float | None = None,
        **engine_kwargs: Any,
    ) -> None:
        _check_args(warmup, cache_dir, pause_timeout_s, engine_kwargs, "LLM()")  # before loading
        # On a mesh the weights are loaded straight into their shardings.
        mesh = mesh if mesh is not None else shardings.default_mesh()
        model_config, module, tokenizer = models.load_model(
            model,
            dtype=dtype,
            seed=seed,
            mesh=mesh,
            scan_layers=scan_layers,
            quantization=quantization,
        )
        config = _engine_config(config or default_engine_config(model_config, seed), engine_kwargs)
        draft = _draft_model(models, config, tokenizer, dtype=dtype, seed=seed, mesh=mesh)
        # Where `chat` finds the chat template: the checkpoint's directory (none for presets).
        name = os.fspath(model)
        checkpoint_dir = (
            None
            if name in models.PRESETS
            else models.CHECKPOINTS.get(name, name if os.path.isdir(name) else None)
        )
        self._start(
            Engine(module, config, tokenizer=tokenizer, mesh=mesh, draft_model=draft),
            model_config,
            checkpoint_dir=checkpoint_dir,
            warmup=warmup,
            pause_timeout_s=pause_timeout_s,
        )

    @classmethod
    def from_model(
        cls,
        model: nnx.Module,
        *,
        tokenizer: Any = None,
        mesh: Any = None,
        draft_model: nnx.Module | None = None,
        config: EngineConfig | None = None,
        warmup: bool | str = True,
        cache_dir: str | None = None,
        pause_timeout_s: float | None = None,
        **engine_kwargs: Any,
    ) -> LLM:
        """An `LLM` serving `model`, an NNX causal LM already built (e.g.
        `paxkv.models.init_model(config)` holding a trainer's weights; see `Engine` for
        what it must offer), with `tokenizer` (`encode`, `decode`; None: token ids only).
        The engine holds `model`'s arrays as they are, placed on `mesh` (None: one
        device); the other arguments are `LLM`'s."""
        _check_args(warmup, cache_dir, pause_timeout_s, engine_kwargs, "LLM.from_model()")
        mesh = mesh if mesh is not None else shardings.default_mesh()
        model_config = model.config
        config = _engine_config(config or default_engine_config(model_config), engine_kwargs)
        llm = cls.__new__(cls)
        llm._start(
            Engine(model, config, tokenizer=tokenizer, mesh=mesh, draft_model=draft_model),
            model_config,
            checkpoint_dir=None,
            warmup=warmup,
            pause_timeout_s=pause_timeout_s,
        )
        return llm

    def _start(
        self,
        engine: Engine,
        model_config: Any,
        *,
        checkpoint_dir: str | None,
        warmup: bool | str,
        pause_timeout_s: float | None,
    ) -> None:
        self.engine = engine
        self._model_config = model_config  # what checkpoints for `update_weights` must match
        self._request_ids = itertools.count()
        # Each live call's outputs, kept for it while another call steps the engine.
        self._router = CallMailboxes(self.engine, pause_timeout_s)
        self._checkpoint_dir = checkpoint_dir
        self._tokenizer_config_file = models.TOKENIZER_CONFIG_FILE
        if warmup:
            self._warm_up(background=warmup in (True, "background"))

    def _check_runnable(self) -> None:
        """A call may start: RuntimeError while paused (no one would resume it), the
        engine's `EngineAsleep` while it sleeps refusing requests."""
        if self.engine.paused and not self.engine.asleep:
            raise RuntimeError("the engine is paused: engine.resume() it first")
        self.engine.check_accepting()

    def _warm_up(self, *, background: bool) -> None:
        bar = tqdm(desc="Compiling step programs", unit="program")

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        with bar, logging_above_bars():
            self.engine.warmup(progress=progress, background=background)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None when it has none)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompts,
        sampling_params: Params = None,
        *,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions of every prompt; returns them in the prompts' order.

        A prompt is a string (needs a tokenizer) or `{"prompt_token_ids": [...]}`.
        `sampling_params` is one for all prompts or one per prompt. Every prompt is
        validated before any runs: a bad one raises ValueError naming its index, and
        nothing is submitted. `use_tqdm` shows vLLM's "Processed prompts" bar on stderr
        (requests finished, with input and output token throughput); a callable is the
        tqdm-like class to make it with.

        Each output is the request's whole final output, whatever the params'
        `output_kind`: as vLLM does, the requests run with `FINAL_ONLY` (on copies of
        the params), so no output is built before a request ends.

        `lora_request` (with `enable_lora=True`): the LoRA adapter of every prompt, or
        one per prompt (None: the base model): a `LoRARequest`, loaded at first use, or
        the name of one loaded (docs/lora.md).
        """
        return self._generate(prompts, sampling_params, use_tqdm, what="prompt", lora=lora_request)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: Params = None,
        *,
        use_tqdm: UseTqdm = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates the next message of each conversation; one output per conversation.

        `messages` is one conversation (a list of {"role", "content"} dicts, content a
        str) or a list of them. Each is rendered with the chat template, as transformers'
        `apply_chat_template` renders it (`paxkv.text.chat`), and tokenized with no special
        tokens added (the template writes them). The template is `chat_template` (Jinja
        source, or the name of one of the checkpoint's templates), else the checkpoint's:
        `chat_template` in its `tokenizer_config.json` or its `chat_template.jinja`.
        `add_generation_prompt` ends the prompt with the header of an assistant turn;
        `continue_final_message` (with `add_generation_prompt=False`) makes the model
        continue the final message instead. `chat_template_kwargs` are more variables for
        the template. Each output's `prompt` is the rendered text. Everything is checked
        before anything is submitted: ValueError or TypeError naming the conversation,
        the message and the field; ValueError when there is no template or tokenizer.
        `lora_request` as in `generate`.
        """
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(
                "chat() needs a tokenizer, and this model has none: LLM reads a checkpoint's "
                "tokenizer.json with the tokenizers package (pip install -e '.[tokenizers]')"
            )
        conversations = chat_templates.parse_conversations(messages)
        templates = self.chat_templates
        texts = chat_templates.render(
            templates.get(chat_template),
            conversations,
            special_tokens=templates.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        prompts = [
            {"prompt_token_ids": chat_templates.encode_rendered(tokenizer, t)} for t in texts
        ]
        outputs = self._generate(
            prompts, sampling_params, use_tqdm, what="conversation", lora=lora_request
        )
        return [dataclasses.replace(o, prompt=t) for o, t in zip(outputs, texts, strict=True)]

    def generate_stream(
        self,
        prompts: Prompts,
        sampling_params: Params = None,
        *,
        use_tqdm: UseTqdm = False,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like `generate`, but yields each request's outputs as it advances.

        What each output holds is its params' `output_kind` (`RequestOutputKind`), as in
        vLLM: CUMULATIVE (the default) the completions so far, every time they advance;
        DELTA only the new tokens and text since the request's previous output (with
        n > 1, only the completions that advanced); FINAL_ONLY one output when the
        request ends. The last output of a request has `finished=True`. A stream yields
        its own requests' outputs only, and all of them, whatever other streams and
        `generate` calls run meanwhile (their steps keep its outputs for it). Closing the
        iterator early, or dropping it, aborts its requests still running; so does an
        exception raised while it steps (a `use_tqdm` bar's included). The progress bar
        is off by default here: the caller sees progress already. `lora_request` as in
        `generate`.
        """
        bar = _Progress(use_tqdm)
        ids, params, box = self._submit(prompts, sampling_params, what="prompt", lora=lora_request)
        deltas = {
            rid
            for rid, p in zip(ids, params, strict=True)
            if p.output_kind is RequestOutputKind.DELTA
        }
        yield from self._router.outputs(ids, bar, deltas, box)

    def score(
        self,
        prompts: Sequence[str | Sequence[int]],
        completions: Sequence[str | Sequence[int]],
        *,
        use_tqdm: UseTqdm = False,
    ) -> list[np.ndarray]:
        """Teacher-forced log-probabilities: for each pair `(prompts[i], completions[i])`,
        f32[len(completion tokens)], each completion token's logprob given the prompt and
        the completion tokens before it, under the raw distribution (log_softmax of the
        f32 logits). Nothing is generated.

        A prompt or completion is a string (tokenized on its own: the completion's
        tokens follow the prompt's) or a list of token ids. Pairs are scored in one
        batch (`Engine.add_score_request`); to score n completions of one prompt, repeat
        the prompt: they share its cached pages. Every pair is validated before any
        runs: a bad one raises ValueError naming its index.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        self._check_runnable()
        tok = self.engine.tokenizer
        pairs = [
            (_token_ids(tok, "prompts", i, p), _token_ids(tok, "completions", i, c))
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]
        ids = [str(next(self._request_ids)) for _ in pairs]
        box = self._router.open(ids)
        for i, (rid, (p, c)) in enumerate(zip(ids, pairs, strict=True)):
            try:
                self.engine.add_score_request(rid, p, c)
            except (TypeError, ValueError) as e:
                self._router.close(ids)
                for queued in ids[:i]:
                    self.engine.abort(queued)
                self._router.step(report_only=True)  # reports, and so forgets, the aborted
                raise type(e)(f"pair {i}: {e}") from None
        outs = self._router.outputs(ids, _Progress(use_tqdm), set(), box)
        final = {out.request_id: out.scores for out in outs if out.finished}
        return [final[i] for i in ids]

    def update_weights(self, weights: Any, *, policy: str = "wait", copy: bool = True) -> int:
        """Installs new weights without a recompilation (`Engine.update_weights`);
        returns the new weight version.

        `weights` is a parameter tree, or the path of a Hugging Face safetensors or
        orbax (`save_params`) checkpoint of the same architecture: its `config.json`
        must equal the model's except for the dtype and how layers are held, and it is
        loaded in the model's dtype (cast, as loading casts) and straight into the
        mesh's shardings. Raises ValueError, the engine keeping its weights, for a
        checkpoint or tree that does not match.
        """
        if isinstance(weights, (str, os.PathLike)):
            weights = read_params(os.fspath(weights), self._model_config, self.engine.mesh)
            copy = False  # the loaded arrays are the engine's alone
        return self.engine.update_weights(weights, policy=policy, copy=copy)

    def sleep(self, level: int = 1, *, weights: str = "host", requests: str = "wait") -> dict:
        """Frees the engine's device memory until `wake_up` (`Engine.sleep`: level 1 the
        KV pool, level 2 the weights too, to host memory or dropped); calls made while
        asleep wait for the wake-up, or with `requests="refuse"` raise `EngineAsleep`.
        Returns {"released_bytes", "seconds"}."""
        return self.engine.sleep(level, weights=weights, requests=requests)

    def wake_up(self) -> dict:
        """Places back what `sleep` freed, in the same shardings, and serves again
        (`Engine.wake_up`); returns {"restored_bytes", "seconds"}."""
        return self.engine.wake_up()

    def get_weights(self) -> dict[str, Any]:
        """The parameters the engine steps with, as a nested dict in the model's layout
        (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`'s; what `update_weights` takes),
        without a copy: each leaf is the engine's own array, so read it (a trainer's
        reference forward, a checkpoint) but never delete or donate it. After
        `update_weights` the dict holds the old arrays: call again. On a mesh whose
        model axis outnumbers the KV heads, the engine holds each K/V head repeated;
        those projections come back as the model holds them (new arrays, sliced)."""
        runner = self.engine.runner
        factor = getattr(getattr(runner, "param_source", None), "kv_head_factor", 1)
        head_dim = getattr(self._model_config, "head_dim", None)
        kept = [
            (p, v.replace(_one_kv_head_each(p, v.get_value(), factor, head_dim)))
            for p, v in nnx.to_flat_state(runner.params)
            if isinstance(v, nnx.Param)
        ]
        return nnx.to_pure_dict(nnx.from_flat_state(kept))

    def stats(self) -> dict[str, Any]:
        """The engine's counters (see `Engine.stats`)."""
        return self.engine.stats()

    @functools.cached_property
    def chat_templates(self) -> chat_templates.ChatTemplates:
        """The checkpoint's chat templates (`tokenizer_config.json`, `chat_template.jinja`;
        none for a preset), read on first use."""
        return chat_templates.ChatTemplates.from_checkpoint(
            self._checkpoint_dir, self._tokenizer_config_file
        )

    def _generate(
        self,
        prompts: Prompts,
        sampling_params: Params,
        use_tqdm: UseTqdm,
        *,
        what: str,
        lora: Any = None,
    ) -> list[RequestOutput]:
        bar = _Progress(use_tqdm)
        ids, _, box = self._submit(
            prompts,
            sampling_params,
            what=what,
            output_kind=RequestOutputKind.FINAL_ONLY,
            lora=lora,
        )
        final = {
            out.request_id: out
            for out in self._router.outputs(ids, bar, set(), box)
            if out.finished
        }
        return [final[i] for i in ids]

    def _submit(
        self,
        prompts: Prompts,
        sampling_params: Params,
        *,
        what: str,
        output_kind: RequestOutputKind | None = None,
        lora: Any = None,
    ) -> tuple[list[str], list[SamplingParams], Any]:
        """Validates every prompt (errors name `what` and its index), then queues them
        all; returns their ids, params and the box their outputs are filed in from the
        start (`CallMailboxes.open`). `output_kind` replaces the params' own (on copies:
        the caller's are not changed). `lora`: one LoRA request for all, or one each;
        their adapters are loaded (and checked) before anything is queued."""
        self._check_runnable()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} {what}s")
        ids = [str(next(self._request_ids)) for _ in prompts]
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params, strict=True)):
            try:
                self.engine.requests.validate(rid, prompt, p)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{what} {i}: {e}") from None
        if lora is None or isinstance(lora, (LoRARequest, str)):  # str: a loaded one's name
            loras = [lora] * len(prompts)
        else:
            loras = list(lora)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(loras)} lora_requests for {len(prompts)} {what}s")
        for i, request in enumerate(loras):
            try:
                if isinstance(request, LoRARequest):
                    self.engine.add_lora(request)
                elif request is not None:  # a loaded adapter's name
                    self.engine.check_lora(request)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{what} {i}: lora_request: {e}") from None
        if output_kind is not None:
            copies = {
                id(p): dataclasses.replace(p, output_kind=output_kind)
                for p in params
                if p.output_kind is not output_kind
            }
            params = [copies.get(id(p), p) for p in params]
        box = self._router.open(ids)
        try:
            for rid, prompt, p, request in zip(ids, prompts, params, loras, strict=True):
                self.engine.add_request(rid, prompt, p, lora_request=request)
        except BaseException:
            self._router.close(ids)
            raise
        return ids, params, box


class _Progress:
    """vLLM's "Processed prompts" bar: requests finished, and the tokens per second read
    and written so far (of the finished requests, as vLLM counts them; delta outputs'
    tokens as they come)."""

    def __init__(self, use_tqdm: UseTqdm) -> None:
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise TypeError(
                f"use_tqdm must be a bool or a tqdm-like class, got {type(use_tqdm).__name__}"
            )
        self._make = (tqdm if use_tqdm is True else use_tqdm) if use_tqdm is not False else None
        self._bar = None
        self._logging = contextlib.ExitStack()  # log records go above the bar while it is open
        self._input_tokens = self._output_tokens = 0

    def start(self, total: int) -> None:
        """Shows the bar (when on) for `total` requests."""
        if self._make is not None:
            self._bar = self._make(
                total=total, desc="Processed prompts", dynamic_ncols=True, postfix=self._speed(0.0)
            )
            self._logging.enter_context(logging_above_bars())

    def advanced(self, out: RequestOutput, *, delta: bool) -> None:
        """Counts an output: its tokens if it is a `delta` one, and the request if it
        finished (with its tokens, if they are all in `out`)."""
        if self._bar is None:
            return
        if delta or out.finished:
            self._output_tokens += sum(len(c.token_ids) for c in out.outputs)
        if not out.finished:
            return
        self._input_tokens += len(out.prompt_token_ids)
        self._bar.set_postfix_str(self._speed(self._bar.format_dict["elapsed"]), refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        """Closes the bar, if shown."""
        if self._bar is not None:
            self._bar.close()
        self._logging.close()

    def _speed(self, elapsed: float) -> str:
        if elapsed <= 0:
            return "est. speed input: 0.00 toks/s, output: 0.00 toks/s"
        return (
            f"est. speed input: {self._input_tokens / elapsed:.2f} toks/s, "
            f"output: {self._output_tokens / elapsed:.2f} toks/s"
        )


def _token_ids(tokenizer: Any, what: str, index: int, text_or_ids: Any) -> list[int]:
    """A prompt or completion of `LLM.score` as token ids (a string is tokenized)."""
    if not isinstance(text_or_ids, str):
        return check_token_ids(f"{what}[{index}]", text_or_ids, lo=None)
    if tokenizer is None:
        raise ValueError(f"{what}[{index}] is a string, and the model has no tokenizer")
    return list(tokenizer.encode(text_or_ids))


def read_params(path: str, model_config: Any, mesh: Any = None) -> Any:
    """The parameter state of the checkpoint at `path` (Hugging Face safetensors or
    orbax), loaded in `model_config`'s dtype into `mesh`'s shardings; ValueError naming
    the differing fields if its `config.json` is of another architecture than
    `model_config` (dtype and how layers are held aside)."""
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a checkpoint directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path!r} is not a checkpoint directory: it holds no config.json (the model's "
            "architecture, written beside the weights)"
        )
    mine = model_config
    theirs = models.read_hf_config(path).replace(dtype=mine.dtype, scan_layers=mine.scan_layers)
    if theirs != mine:
        differ = [
            f"{f.name}={getattr(theirs, f.name)!r} (the model's: {getattr(mine, f.name)!r})"
            for f in dataclasses.fields(mine)
            if getattr(theirs, f.name) != getattr(mine, f.name)
        ]
        raise ValueError(f"checkpoint {path} is of another architecture: {', '.join(differ)}")
    _, module, _ = models.load_model(
        path, dtype=mine.dtype, mesh=mesh, scan_layers=mine.scan_layers
    )
    return nnx.state(module, nnx.Param)


def _engine_config(config: EngineConfig, engine_kwargs: dict[str, Any]) -> EngineConfig:
    """`config` with `engine_kwargs` (`EngineConfig` fields) in place."""
    _check_engine_kwargs(engine_kwargs)
    return dataclasses.replace(config, **engine_kwargs)


def _draft_model(
    models: Any, config: EngineConfig, tokenizer: Any, *, dtype: str | None, seed: int, mesh: Any
) -> Any:
    """The draft model that `config.speculative_config` names (method "draft_model"),
    loaded like the target; None without one. ValueError when its tokenizer differs
    from the target's (a draft must propose the target's token ids)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    _, draft, draft_tokenizer = models.load_model(spec.model, dtype=dtype, seed=seed, mesh=mesh)
    probe = "def f(x):\n    return [x, 'é', 3.14]  # draft\n"
    if (tokenizer is None) != (draft_tokenizer is None) or (
        tokenizer is not None and tokenizer.encode(probe) != draft_tokenizer.encode(probe)
    ):
        raise ValueError(
            f"speculative_config.model={spec.model!r}: the draft's tokenizer differs from "
            "the target's (they encode the same text to different ids); a draft model must "
            "share the target's tokenizer"
        )
    return draft


def _one_kv_head_each(path: tuple, x: Any, factor: int, head_dim: int | None) -> Any:
    """A K/V projection leaf (`self_attn.{k,v}_proj.{kernel,bias}`) whose heads the
    engine repeated `factor` times (`duplicate_kv_heads`), with one of each; any other
    leaf as it is."""
    names = [str(k) for k in path]
    if factor == 1 or names[-1] not in ("kernel", "bias") or names[-2] not in ("k_proj", "v_proj"):
        return x
    heads = x.reshape(*x.shape[:-1], -1, head_dim)  # [..., Hkv * factor, D]
    return heads[..., ::factor, :].reshape(*x.shape[:-1], -1)


def _check_args(
    warmup: Any, cache_dir: Any, pause_timeout_s: Any, engine_kwargs: dict[str, Any], caller: str
) -> None:
    """The arguments `LLM()` and `LLM.from_model` share, checked before anything loads
    (ValueError or TypeError naming the one that is wrong); then the compilation cache
    of `cache_dir`, if given, is enabled."""
    if warmup not in WARMUP_MODES or not isinstance(warmup, bool | str):
        raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
    if pause_timeout_s is not None and check_float("pause_timeout_s", pause_timeout_s) < 0:
        raise ValueError(f"pause_timeout_s={pause_timeout_s} must be >= 0 (None: no limit)")
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        raise TypeError(f"cache_dir must be a path or 'off', got {cache_dir!r}")
    _check_engine_kwargs(engine_kwargs, caller)
    if cache_dir is not None:
        compile_cache.enable(os.fspath(cache_dir))


def _check_engine_kwargs(engine_kwargs: dict[str, Any], caller: str = "LLM()") -> None:
    """TypeError naming any argument that is not an `EngineConfig` field."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise TypeError(
            f"{caller} got unknown arguments {unknown}; engine options are {sorted(known)}"
        )
