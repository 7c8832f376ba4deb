"""The seam between the engine's host path and the compiled step.

The engine lays out each step as a `HostBatch` (NumPy) and hands it to a step runner.
`ModelRunner` runs the jitted model (`paxkv.engine.device.step`) on the device: it owns the
weights, the KV cache and the previous step's sampled tokens. `FakeRunner`
(`paxkv.engine.fake_runner`) returns deterministic tokens computed on the host without
touching a device, so everything
else of the engine (scheduling, batch layout, outputs, metrics) can be tested and
benchmarked on its own (`benchmarks.host_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from paxkv.engine import sleep
from paxkv.engine.compilations import CompileCounter
from paxkv.engine.config import EngineConfig
from paxkv.engine.device import lora_slots
from paxkv.engine.device import step as steps
from paxkv.engine.device.draft import check_draft_model
from paxkv.engine.device.sampling import Sampled
from paxkv.engine.device.step import DecodeLimits, ForwardBatch, StepExtras
from paxkv.engine.params import ParamSource
from paxkv.engine.programs import Program, Programs, default_compile_threads
from paxkv.host.batch import HostBatch, history_length, mask_words, pad_host_batch
from paxkv.host.kv_groups import KVCacheGroups
from paxkv.kv_cache import PagedKVCache, page_copies
from paxkv.sharding import shardings


@dataclasses.dataclass
class Deferred:
    """A step whose forward is dispatched and whose sampler waits for the host to fill
    `allowed` (`HostBatch.allowed`: the token masks of its constrained sequences, all
    bits set until then): `StepRunner.finish` dispatches the sampler."""

    allowed: np.ndarray  # i32[S * positions, W]
    resume: Callable[[np.ndarray], Any]  # the masks -> the step's handle
    positions: int = 1  # rows of `allowed` per sequence: 1 + the step's draft width


class StepRunner:
    """What the engine needs of a compiled step. Subclasses implement all of it.

    `model_config` has `vocab_size`, `eos_token_ids` and optionally
    `max_position_embeddings`. `dispatch` starts a step and returns a handle without
    waiting (the async pipeline schedules the next step meanwhile); `fetch` waits and
    returns its samples on the host. A step's sequence s samples into row s, and a
    later step's `token_src` rows index the previous dispatched step's rows.
    """

    model_config: Any
    num_compilations: int = 0
    num_model_compilations: int = 0
    num_cache_loads: int = 0
    compile_seconds: float = 0.0
    # `(L, k)` of the routing a model that routes experts returns with every step
    # (`fetch_routing`): its MoE layers and top k. None: the model routes none.
    routing_shape: tuple[int, int] | None = None

    def dispatch(self, hb: HostBatch) -> Any:
        """Starts one step of `hb`; returns a handle for `fetch`."""
        raise NotImplementedError

    def finish(self, handle: Any) -> Any:
        """A dispatched step's handle for `fetch`: a `Deferred` step's sampler dispatched
        with its masks as filled now; any other handle as it is."""
        return handle.resume(handle.allowed) if isinstance(handle, Deferred) else handle

    def fetch(self, handle: Any) -> Sampled:
        """The samples of a dispatched step, as NumPy arrays (rows: max_num_seqs)."""
        raise NotImplementedError

    def fetch_routing(self, handle: Any) -> np.ndarray:  # i32[L, T, k]
        """The experts each MoE layer of a dispatched step sent each packed row to,
        copied to the host (only steps whose routing a request asks for pay it)."""
        raise ValueError("the model routes no experts (routing_shape is None)")

    def decode_loop(
        self, hb: HostBatch, stop_ids: Sequence[tuple[int, ...]], limits: Sequence[int]
    ) -> Any:
        """Starts `num_decode_steps` decode iterations of a decode-only batch (see
        `paxkv.engine.device.step.decode_loop`); returns a handle for `fetch_loop`."""
        raise NotImplementedError

    def fetch_loop(self, handle: Any) -> tuple[Sampled, np.ndarray]:
        """The samples of a dispatched decode loop on the host: arrays [N, S, ...], and
        `valid` bool[N, S]."""
        raise NotImplementedError

    def warmup(
        self,
        shapes: Sequence[tuple[int, int, int]],
        progress: Callable[[int, int], None] | None,
        *,
        scoring: bool = True,
        background: bool = False,
    ) -> None:
        """Compiles the programs of every `(T, S, pages per sequence)` shape (`scoring`:
        the samplers of scored prompt rows too), calling `progress(done, total)` as each
        program is ready; with `background`, those of the largest shape now and the
        others while the engine serves."""

    def restore_cache(self) -> bool:
        """After a call that raised: whether the KV cache was lost (donated to a call
        whose result never came back), in which case a new, empty one replaces it."""
        return False

    def release(self, weights: str | None) -> tuple[int, Any]:
        """Frees the device memory of the KV cache and, with `weights` ("host": copied
        to host memory first; "drop"), of the parameters (`paxkv.engine.sleep`); the
        bytes freed and the host copy for `restore`. Here: nothing to free."""
        return 0, None

    def restore(self, host: Any) -> int:
        """Places back what `release` freed (the parameters from `host` unless new ones
        came since), in the same shardings; the bytes placed."""
        return 0


class ModelRunner(StepRunner):
    """Runs the jitted model step on the device (or a mesh of devices).

    Args:
      model: the NNX causal LM (see `paxkv.engine.Engine`).
      config: the engine's settings, `num_decode_steps` decided.
      mesh: a `jax.sharding.Mesh` of one replica, or None for one device.
      draft_model: the draft model of speculative decoding's "draft_model" method
        (`paxkv.engine.device.draft`), with its own cache over the same pages; None: none.
    """

    def __init__(
        self,
        model: nnx.Module,
        config: EngineConfig,
        mesh: Any = None,
        draft_model: nnx.Module | None = None,
    ) -> None:
        mc = model.config
        factor = 1
        if mesh is not None and hasattr(model, "duplicate_kv_heads"):
            # A model axis the KV heads do not split: repeat them until it does, so each
            # device holds the pages of only the heads its query heads read.
            factor = shardings.kv_head_factor(mc.num_kv_heads, mc.num_heads, mesh)
        # The caller's layout, which `update_weights` takes and turns into the runner's.
        self.param_source = ParamSource.of(model, factor)
        if factor > 1 or config.enable_lora:
            model = nnx.clone(model)  # new variables: the caller's model is unchanged
        if factor > 1:
            model.duplicate_kv_heads(factor)
            mc = model.config
        if config.enable_lora:
            if not hasattr(model, "add_lora_slots"):
                raise ValueError(
                    f"enable_lora=True: {type(model).__name__} has no LoRA slots "
                    "(add_lora_slots); the families of paxkv.models have"
                )
            model.add_lora_slots(config.max_loras, config.max_lora_rank, config.lora_method)
        self.model_config = mc
        self.config = config
        if getattr(model, "routes_experts", False):
            self.routing_shape = (mc.num_layers, mc.num_experts_per_tok)
        self.mesh = mesh
        # Which layers share a page table (one group unless the model mixes windows).
        self.kv_groups = KVCacheGroups.for_model(mc, hybrid=config.hybrid_kv_cache)
        self.target = PlacedModel(model, config, self.kv_groups, mesh)
        # What the last step left the next (`paxkv.engine.device.step.Carried`).
        carried = steps.Carried.zeros(config.max_num_seqs)
        if mesh is not None:  # as the step returns it, so warm-up compiles the real signature
            self._carried = jax.device_put(carried, shardings.replicated(mesh))
        else:  # committed to its device, as `PlacedModel`'s arrays are
            self._carried = jax.device_put(carried, carried.tokens.sharding)
        self._no_rejections = self._carried.rejected
        self._compiles = CompileCounter(
            steps.COMPILED_FUNCTIONS
            + page_copies.COMPILED_FUNCTIONS
            + lora_slots.COMPILED_FUNCTIONS
        )
        self._programs = Programs(self._compiles)
        # The step batch, placed as the programs were lowered for: replicated on a mesh.
        self._batch_sharding = shardings.replicated(mesh) if mesh is not None else None
        self._out_info: dict[str, Any] = {}  # each program's outputs (shapes, shardings)
        # With a warm-up in the background: the step shapes, each step run on the
        # smallest compiled one that holds it.
        self._shapes: list[tuple[int, int, int]] | None = None
        self.draft = None
        if draft_model is not None:  # its pages mirror the target's: one block table for both
            draft_groups = KVCacheGroups.for_model(
                draft_model.config, hybrid=config.hybrid_kv_cache
            )
            check_draft_model(draft_model.config, mc, draft_groups, self.kv_groups)
            self.draft = PlacedModel(draft_model, config, draft_groups, mesh)

    @property
    def params(self) -> Any:
        """The target model's parameters (`update_weights` replaces them)."""
        return self.target.params

    @params.setter
    def params(self, params: Any) -> None:
        self.target.params = params

    @property
    def kv_cache(self) -> PagedKVCache:
        """The target model's KV cache."""
        return self.target.cache

    def restore_cache(self) -> bool:
        """A new, empty cache in the old one's shardings if a step call that raised had
        been given the cache (donated: its buffers are deleted), the draft model's too.
        Whether it did."""
        lost = self.draft is not None and self.draft.restore_cache()
        return self.target.restore_cache() or lost

    def release(self, weights: str | None) -> tuple[int, Any]:
        """The caches (the draft model's too) freed, and with `weights` the target's
        parameters (`StepRunner.release`)."""
        freed = sleep.release_arrays(self.target.cache)
        if self.draft is not None:
            freed += sleep.release_arrays(self.draft.cache)
        host = None
        if weights is not None:
            self.target.params, host, params_freed = sleep.offload_params(
                self.target.params, keep=weights == "host"
            )
            freed += params_freed()
        return freed, host

    def restore(self, host: Any) -> int:
        """The parameters, then new empty caches, in their shardings (`StepRunner.restore`);
        raises ValueError, placing nothing, for weights dropped and not replaced."""
        self.target.params, placed = sleep.restore_params(self.target.params, host)
        self.restore_cache()
        placed += sum(a.nbytes for a in jax.tree.leaves(self.target.cache))
        if self.draft is not None:
            placed += sum(a.nbytes for a in jax.tree.leaves(self.draft.cache))
        return placed

    # Whole pages to and from host memory (the host KV tier, `paxkv.engine.host_tier`).

    def _caches(self) -> list[PlacedModel]:
        return [self.target] + ([self.draft] if self.draft is not None else [])

    def page_bytes(self) -> int:
        """Bytes of one page over every cache array (the draft model's too)."""
        return sum(page_copies.page_bytes(m.cache) for m in self._caches())

    def read_pages(self, pages: np.ndarray) -> list[tuple[jax.Array, ...]]:
        """Dispatches the read of `pages` (i32[B]) out of each cache (the target's, then
        the draft model's), every array's rows `[B * r, ...]`; runs after the calls
        dispatched before it, before those dispatched after (the device's order)."""
        with self._compiles.counting():
            return [
                page_copies.read_pages(m.cache, page_copies.page_rows(m.cache, pages))
                for m in self._caches()
            ]

    def write_pages(self, pages: np.ndarray, data: Sequence[Sequence[np.ndarray]]) -> None:
        """Dispatches the write of `data` (`read_pages`' layout, on the host) into
        `pages` (i32[B]) of each cache."""
        with self._compiles.counting():
            for m, arrays in zip(self._caches(), data, strict=True):
                rows = page_copies.page_rows(m.cache, pages)
                cache = page_copies.write_pages(m.cache, rows, tuple(arrays))
                # In the shardings the steps were compiled for (a no-op when they are).
                m.cache = jax.device_put(cache, m.cache_shardings)

    # LoRA adapter slots (`paxkv.models.lora`; `config.enable_lora`).

    def lora_slot_contents(self, adapter: Any) -> dict[tuple, np.ndarray]:
        """One slot's contents (by state path) for `adapter`, a PEFT checkpoint
        directory or `(state_dict, adapter_config)`; ValueError naming the file and
        field for one this model cannot take."""
        model = nnx.merge(self.target.graphdef, self.target.params)
        return model.lora_slot_contents(adapter, self.config.max_lora_rank)

    def write_lora_slot(self, slot: int, contents: dict[tuple, np.ndarray] | None) -> None:
        """Dispatches the write of `contents` (`lora_slot_contents`; None: zeros) into
        slot `slot` of the target's slot arrays; runs after the steps dispatched before
        it, before those after (the device's order)."""
        target = self.target
        flat = list(nnx.to_flat_state(target.params))
        at = [i for i, (path, _) in enumerate(flat) if path[-1] in shardings.LORA_ARRAYS]
        arrays = [flat[i][1].get_value() for i in at]
        if contents is None:
            values = lora_slots.zero_slot(arrays)
        else:
            values = [contents[tuple(flat[i][0])] for i in at]
        placed = [a.sharding for a in arrays]
        with self._compiles.counting():
            new = lora_slots.write_slot(arrays, np.int32(slot), values)
        new = jax.device_put(new, placed)  # as the steps were compiled (a no-op if so)
        for i, a in zip(at, new, strict=True):
            flat[i] = (flat[i][0], flat[i][1].replace(a))
        target.params = nnx.from_flat_state(flat)

    def rows_per_page(self) -> list[int]:
        """Rows of each cache's arrays holding one page (`read_pages`' `r`)."""
        return [page_copies.rows_per_page(m.cache) for m in self._caches()]

    @property
    def num_compilations(self) -> int:
        """Compilations of the step functions that this runner's calls triggered (a
        program loaded from the persistent compilation cache included)."""
        return self._compiles.count

    @property
    def num_cache_loads(self) -> int:
        """Of `num_compilations`, the programs loaded from the persistent cache."""
        return self._compiles.loaded

    @property
    def num_model_compilations(self) -> int:
        """Of `num_compilations`, the programs that run the model (not the samplers)."""
        return sum(self._compiles.by_function[f"jit({f})"] for f in steps.MODEL_FUNCTIONS)

    @property
    def compile_seconds(self) -> float:
        """Seconds those compilations took."""
        return self._compiles.seconds

    @property
    def programs_reused(self) -> int:
        """Programs this runner took from ones the process had compiled already."""
        return self._programs.loaded

    @property
    def programs_compiled(self) -> list[tuple[str, tuple]]:
        """The `(name, shape key)` of each program this runner compiled, in order."""
        return list(self._programs.compiled)

    # The programs of a step, by name and shape key (`paxkv.engine.programs`).

    def _statics(self) -> dict[str, Any]:
        return {
            "attention_backend": self.config.step_attention_backend,
            "num_logprobs": self.config.max_logprobs,
        }

    def _batch(self, t: int, s: int, p: int, **sizes: int) -> tuple[ForwardBatch, StepExtras]:
        page_size, groups = self.config.page_size, self.kv_groups.num_groups
        return steps.abstract_step_batch(
            t, s, p, page_size, groups, sharding=self._batch_sharding, **sizes
        )

    def _forward_program(self, key: tuple[int, int, int]) -> Program:
        target = self.target
        forward, _ = self._batch(*key)
        args = (target.graphdef, target.params, target.cache, forward, self._carried)
        return Program("forward", key, steps.FORWARD, args, self._statics())

    def _draft_program(self, key: tuple[int, int, int, int, int]) -> Program:
        t, s, p, k, h = key
        draft = self.draft
        forward, extras = self._batch(t, s, p, history_len=h, num_draft=k)
        args = (draft.graphdef, draft.params, draft.cache, forward, self._carried)
        args += (extras.penalty_history, extras.draft_counts)
        statics = {"attention_backend": self.config.step_attention_backend, "k": k}
        return Program("draft", key, steps.DRAFT, args, statics)

    def _loop_program(self, key: tuple[int, int, int, int]) -> Program:
        t, s, p, h = key
        target = self.target
        forward, extras = self._batch(t, s, p, history_len=h)
        limits = DecodeLimits.abstract(s, self._batch_sharding)
        args = (target.graphdef, target.params, target.cache, forward, self._carried)
        args += (extras.penalty_history,)
        statics = self._statics() | {"num_steps": self.config.num_decode_steps}
        return Program("loop", key, steps.DECODE_LOOP, (*args, limits), statics)

    def _resample_program(self, key: tuple[int, int, int, int, int, bool, int, int]) -> Program:
        """`key`: (T, or 0 when no row is scored or proposed; S; H; R; k; whether a
        draft model made the proposals; B, the logit biases' width: the programs with
        B > 0 compile when a step first needs them, not in warm-up; W, the token masks'
        words, 0 or the model's)."""
        t, s, h, r, k, drafted, b, w = key
        # Its inputs are a forward's outputs (and a draft's): lowered for their shardings.
        _, last, hidden, _ = self._out_info["forward"]
        resized = lambda a, *shape: jax.ShapeDtypeStruct(shape, a.dtype, sharding=a.sharding)
        last = jax.tree.map(lambda a: resized(a, s, *a.shape[1:]), last)
        hidden = resized(hidden, t, *hidden.shape[1:]) if t else None
        forward, extras = self._batch(
            max(t, 1), s, 1, history_len=h, num_scored=r, num_draft=k, num_bias=b, num_mask=w
        )
        proposals, draft_probs = extras.draft_tokens, None
        if drafted:
            _, out_proposals, out_probs, _ = self._out_info["draft"]
            proposals = resized(out_proposals, s, k)
            draft_probs = resized(out_probs, s, k, self.model_config.vocab_size)
        args = (self.target.graphdef, self.target.params, last, hidden)
        args += (forward.sampling_floats, forward.sampling_ints, extras, proposals, draft_probs)
        statics = {"num_rows": self.config.max_num_seqs, "num_logprobs": self.config.max_logprobs}
        return Program("resample", key, steps.RESAMPLE, args, statics)

    def _spec(self, name: str, key: tuple) -> Program:
        return getattr(self, f"_{name}_program")(key)

    def _program(self, name: str, key: tuple) -> Any:
        """The compiled program `(name, key)`, compiled now if warm-up did not."""
        compiled = self._programs.get(name, key, lambda: self._spec(name, key))
        if name not in self._out_info:
            self._out_info[name] = compiled.out_info
        return compiled

    def _run_step(self, forward: ForwardBatch, extras: StepExtras, allowed: Any = None) -> Any:
        """Dispatches a step's forward and its sampler; with `allowed` (the host's token
        masks, i32[S, W], not filled yet), only the forward: the sampler waits for
        `finish` (returns a `Deferred`)."""
        target, draft = self.target, self.draft
        t, (s, p) = forward.tokens.shape[0], forward.table.block_tables.shape[-2:]
        h = extras.penalty_history.shape[2]
        k = extras.draft_tokens.shape[1]
        proposals, draft_probs = extras.draft_tokens, None
        if draft is not None:  # its proposals fill the rows after each sequence's last
            tokens, out_proposals, out_probs, draft.cache = self._program("draft", (t, s, p, k, h))(
                draft.graphdef,
                draft.params,
                draft.cache,
                forward,
                self._carried,
                extras.penalty_history,
                extras.draft_counts,
            )
            forward = forward.replace(tokens=tokens)
            if k:
                proposals, draft_probs = out_proposals, out_probs
        sampled, last, hidden, target.cache = self._program("forward", (t, s, p))(
            target.graphdef, target.params, target.cache, forward, self._carried
        )
        self._carried = steps.Carried(sampled.tokens, self._no_rejections)

        def resample(mask: Any = None) -> Sampled:
            nonlocal sampled, extras
            if mask is not None:
                extras = steps.with_allowed(extras, mask, self._batch_sharding)
            if not extras.needed:
                return sampled
            # The small sampler of penalties, scored rows, proposals, biases or masks.
            r = extras.score_rows.shape[0]
            wide = bool(r or k)
            b, w = extras.bias_ids.shape[1], extras.allowed.shape[1]
            key = (t if wide else 0, s, h, r, k, draft is not None and k > 0, b, w)
            routing = sampled.routing
            sampled, self._carried = self._program("resample", key)(
                target.graphdef,
                target.params,
                last,
                hidden if wide else None,
                forward.sampling_floats,
                forward.sampling_ints,
                extras,
                proposals,
                draft_probs,
            )
            return sampled.replace(routing=routing)

        if allowed is not None:
            return Deferred(allowed, resample, positions=1 + k)
        return resample()

    def _run_loop(
        self, forward: ForwardBatch, extras: StepExtras, limits: DecodeLimits
    ) -> tuple[Sampled, jax.Array]:
        target = self.target
        t, (s, p) = forward.tokens.shape[0], forward.table.block_tables.shape[-2:]
        key = (t, s, p, extras.penalty_history.shape[2])
        sampled, valid, self._carried, target.cache = self._program("loop", key)(
            target.graphdef,
            target.params,
            target.cache,
            forward,
            self._carried,
            extras.penalty_history,
            limits,
        )
        return sampled, valid

    def dispatch(self, hb: HostBatch) -> Any:
        """Moves `hb` to the device in one transfer and dispatches the step (on the
        smallest compiled shape that holds it, while warm-up compiles in the background);
        a step with token masks (`HostBatch.allowed`) dispatches its forward only
        (`Deferred`)."""
        hb = self._on_compiled_shape(hb, "forward")
        forward, extras = steps.step_batch(hb, self.config.page_size, self._batch_sharding)
        return self._run_step(forward, extras, hb.allowed if hb.allowed.shape[1] else None)

    def _on_compiled_shape(self, hb: HostBatch, name: str) -> HostBatch:
        """`hb`, padded to the smallest compiled shape that holds it if its own program
        (`name`: "forward" or "loop") is still compiling in the background."""
        if self._shapes is None:
            return hb
        t, s, p = hb.tokens.shape[0], hb.logits_indices.shape[0], hb.block_tables.shape[-1]
        page_size, h, k = (
            self.config.page_size,
            hb.penalty_history.shape[2],
            hb.draft_tokens.shape[1],
        )

        def ready(shape: tuple[int, int, int]) -> bool:
            if name == "loop":
                return (
                    "loop",
                    (*shape, history_length(shape[2], page_size) if h else 0),
                ) in self._programs
            drafted = self.draft is None or ("draft", (*shape, k, h)) in self._programs
            return ("forward", shape) in self._programs and drafted

        if ready((t, s, p)):
            return hb
        fits = [x for x in self._shapes if x[0] >= t and x[1] >= s and x[2] >= p and ready(x)]
        if not fits:  # its own program is compiled (or waited for) when it runs
            return hb
        best = min(fits, key=lambda x: (x[0], x[2], x[1]))
        return pad_host_batch(hb, *best, page_size=page_size)

    def fetch(self, handle: Sampled) -> Sampled:
        """Waits for the step and copies its samples to the host (not its routing)."""
        return jax.device_get(handle.replace(routing=None))

    def fetch_routing(self, handle: Sampled) -> np.ndarray:  # i32[L, T, k]
        """The step's routing (`Sampled.routing`), copied to the host."""
        if handle.routing is None:
            return super().fetch_routing(handle)
        return np.asarray(jax.device_get(handle.routing))

    def decode_loop(
        self, hb: HostBatch, stop_ids: Sequence[tuple[int, ...]], limits: Sequence[int]
    ) -> tuple[Sampled, jax.Array]:
        """Dispatches the N-step decode loop on the device (`paxkv.engine.device.step.DECODE_LOOP`)."""
        hb = self._on_compiled_shape(hb, "loop")
        forward, extras = steps.step_batch(hb, self.config.page_size, self._batch_sharding)
        stops = DecodeLimits.from_host(
            list(stop_ids), list(limits), hb.logits_indices.shape[0], self._batch_sharding
        )
        return self._run_loop(forward, extras, stops)

    def fetch_loop(self, handle: tuple[Sampled, jax.Array]) -> tuple[Sampled, np.ndarray]:
        """Waits for the loop and copies its samples to the host."""
        return jax.device_get(handle)

    def warmup(
        self,
        shapes: Sequence[tuple[int, int, int]],
        progress: Callable[[int, int], None] | None,
        *,
        scoring: bool = True,
        background: bool = False,
    ) -> None:
        """Compiles, for every shape, the step's forward (with a draft model, the draft's
        part too) and the N-step loop, then the samplers those shapes run most: of
        penalties per (S, H), of token masks (structured outputs) per S, and with
        `scoring` of scored rows and with speculative decoding of proposals per (T, S).
        A step with a rarer mix (scored rows, proposals or masks and penalties in one
        step, or proposals and masks) compiles its sampler, a small program of the LM
        head, when first met. `progress(done, total)` counts programs.

        With `background`, only the programs of the largest shape (which holds every
        step) and of the smallest compile now; the others compile in a background
        thread, smallest shapes first, and until its own is ready a step runs on the
        smallest compiled shape that holds it (`pad_host_batch`)."""
        first, second = self.warmup_programs(shapes, scoring=scoring)
        if background:
            # The largest shape holds every step; the smallest runs short requests and
            # decodes without the largest's padding (on a slow device, a padded decode of
            # a large model costs seconds a step).
            top = (max(x[0] for x in shapes), max(x[1] for x in shapes), max(x[2] for x in shapes))
            serving = {top, min(shapes)}
            now = [(n, k) for n, k in first if k[:3] in serving and (n == "forward" or not k[-1])]
            later = sorted((x for x in first if x not in now), key=lambda x: (x[1], x[0]))
            first, second = now, later + second
        total = len(first) + (0 if background else len(second))
        logging.info(
            "paxkv: compiling %d step programs for %d shapes: %d now, %d in the background",
            len(first) + len(second),
            len(shapes),
            len(first) if background else len(first) + len(second),
            len(second) if background else 0,
        )

        def report(offset: int) -> Callable[[int, int], None] | None:
            return None if progress is None else lambda done, _: progress(offset + done, total)

        self._programs.compile([self._spec(n, k) for n, k in first], report(0))
        for name in ("forward", "draft"):  # the samplers are lowered from their outputs
            keys = [k for n, k in first if n == name]
            if keys:
                self._program(name, keys[0])
        rest = [self._spec(n, k) for n, k in second]
        if background:
            self._shapes = list(shapes)
            threads = max(1, default_compile_threads() - 1)  # a core left for serving
            self._programs.compile_in_background(rest, threads=threads)
        else:
            self._programs.compile(rest, report(len(first)))

    @property
    def compiling(self) -> bool:
        """Whether warm-up is still compiling in the background."""
        thread = self._programs.background
        return thread is not None and thread.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Waits for a background warm-up to finish; whether it has."""
        thread = self._programs.background
        if thread is not None:
            thread.join(timeout)
        return not self.compiling

    def warmup_programs(
        self, shapes: Sequence[tuple[int, int, int]], *, scoring: bool = True
    ) -> tuple[list[tuple[str, tuple]], list[tuple[str, tuple]]]:
        """What `warmup` compiles, as `(name, key)`s: the model's programs, then the
        samplers (which are lowered from the forward's outputs)."""
        spec = self.config.speculative_config
        k = 0 if spec is None else spec.num_speculative_tokens
        drafted = self.draft is not None
        page_size = self.config.page_size
        first: list[tuple[str, tuple]] = [("forward", (t, s, p)) for t, s, p in shapes]
        if drafted:
            first += [("draft", (t, s, p, kk, 0)) for t, s, p in shapes for kk in {0, k}]
        if self.config.num_decode_steps > 1:
            for t, s, p in shapes:
                first += [("loop", (t, s, p, h)) for h in (0, history_length(p, page_size))]
        w = mask_words(self.model_config.vocab_size)
        second: dict[tuple[str, tuple], None] = {}
        for t, s, p in shapes:
            second[("resample", (0, s, history_length(p, page_size), 0, 0, False, 0, 0))] = None
            second[("resample", (0, s, 0, 0, 0, False, 0, w))] = None
            if scoring:
                second[("resample", (t, s, 0, t, 0, False, 0, 0))] = None
            if k:
                second[("resample", (t, s, 0, 0, k, drafted, 0, 0))] = None
        return first, list(second)


class PlacedModel:
    """A model's weights and its paged KV cache (`config.num_pages` pages of
    `config.page_size` tokens, laid out by `groups`), on one device or sharded over
    `mesh` (the cache born sharded: no device ever holds all of it).

    Off a mesh the arrays are committed to their device (no copy), as the step's
    outputs and the arrays `update_weights` places are: jit keys on it, so warm-up
    compiles the real signature. On a mesh the weights are spread over its devices (a
    no-op for weights loaded into their shardings, `paxkv.models.load_model`).
    """

    def __init__(
        self, model: nnx.Module, config: EngineConfig, groups: KVCacheGroups, mesh: Any
    ) -> None:
        mc = model.config
        self._new_cache = lambda: shardings.sharded_cache(
            lambda: PagedKVCache.for_model(
                mc, config.num_pages, config.page_size, config.kv_cache_dtype, groups
            ),
            mc.num_kv_heads,
            mesh,
        )
        graphdef, params = nnx.split(model)
        cache = self._new_cache()
        if mesh is not None:
            graphdef, params, cache = shardings.shard_engine_state(graphdef, params, cache, mesh)
        else:
            params, cache = jax.device_put(
                (params, cache), jax.tree.map(lambda x: x.sharding, (params, cache))
            )
        self.graphdef, self.params, self.cache = graphdef, params, cache
        self._cache_shardings = jax.tree.map(lambda a: a.sharding, cache)

    @property
    def cache_shardings(self) -> Any:
        """The cache's shardings, as the steps were compiled for them."""
        return self._cache_shardings

    def restore_cache(self) -> bool:
        """A new, empty cache in the old one's shardings if a failed call had the cache
        donated (its buffers deleted); whether it had."""
        if not any(a.is_deleted() for a in jax.tree.leaves(self.cache)):
            return False
        self.cache = jax.device_put(self._new_cache(), self._cache_shardings)
        return True
