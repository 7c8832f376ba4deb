"""Routing replay for RL: the experts each token of a request was routed to, for the
requests that ask (`SamplingParams.return_routed_experts`).

A model that routes experts returns its routing with every step (`Sampled.routing`,
i32[L, T, k] over the packed rows, always: no second compiled variant), and it is
copied to the host only after steps with a sequence that asks. Each such sequence keeps
a table of its positions, and a step's rows overwrite the positions they computed: a
recomputation (after preemption) replaces the earlier routing, so the table holds the
routing of the computation whose K/V the later tokens read. Such a request reads no
other request's prefix-cache pages (`RoutedExperts.cache_salt`), so a position a
completion did not compute itself was computed by a sibling completion (n > 1) whose
tokens up to it are the same, and takes its routing. The rest stay -1: the last
generated token, which no step feeds back to the model.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from paxkv.engine.outputs import StepOutputs
from paxkv.engine.requests import Request
from paxkv.engine.runner import StepRunner
from paxkv.host.request import RequestOutputKind, SamplingParams
from paxkv.host.scheduler import SchedulerOutput
from paxkv.host.sequence import SequenceState

NOT_ROUTED = -1  # a position the model never computed for the request


class RoutedExperts:
    """The routing tables of the unfinished requests that ask for their routing.

    The engine's model contract: a model with `routes_experts = True`
    (`paxkv.models.MoeForCausalLM`) also takes `return_routing=True` and then returns
    each layer's experts per packed row, i32[L, T, k] (L = `config.num_layers`, k =
    `config.num_experts_per_tok`), which the step passes on (`Sampled.routing`).

    Args:
      runner: copies a step's routing to the host; its `routing_shape` is `(L, k)`.
      speculative: whether the engine decodes speculatively (such requests are refused).
    """

    def __init__(self, runner: StepRunner, *, speculative: bool = False) -> None:
        self.runner = runner
        self.speculative = speculative
        # request id -> its sequences, their tables (i32[capacity, L, k] each), and the
        # results of its finished completions by index (built once)
        self._requests: dict[
            str, tuple[list[SequenceState], list[np.ndarray], dict[int, np.ndarray]]
        ] = {}
        self._salts = itertools.count()

    def cache_salt(
        self, request_id: str | None, params: SamplingParams | None, salt: str | None
    ) -> str | None:
        """The cache salt a request runs with: its own when it does not ask for its
        routing; else one no other request has, after checking that it can be served
        (ValueError naming the field: a model without experts, speculative decoding).
        Such requests share prefix-cache pages only among their own completions."""
        asks = isinstance(params, SamplingParams) and params.return_routed_experts
        if not asks or not isinstance(salt, str | None):
            return salt  # a salt of the wrong type is rejected by `RequestRegistry.create`
        if self.runner.routing_shape is None:
            raise ValueError(
                f"request {request_id!r}: return_routed_experts=True needs a model that "
                "routes experts (Mixtral, Qwen3-MoE, gpt-oss); this one has none"
            )
        if self.speculative:
            raise ValueError(
                f"request {request_id!r}: return_routed_experts=True is not supported with "
                "speculative decoding (EngineConfig.speculative_config)"
            )
        # Unique: its pages match no other request's (whose routing it cannot know).
        return f"{salt or ''}\x00routed-experts-{next(self._salts)}"

    def add(self, request: Request) -> Request:
        """Starts the tables of a submitted request's sequences, if it asks; returns it."""
        seqs = request.seqs
        if seqs[0].params.return_routed_experts:
            self._requests[request.request_id] = (seqs, [self._empty(0) for _ in seqs], {})
        return request

    def _empty(self, num_positions: int) -> np.ndarray:
        return np.full((num_positions, *self.runner.routing_shape), NOT_ROUTED, np.int32)

    def wants(self, plan: SchedulerOutput) -> bool:
        """Whether a sequence of `plan` asks for its routing."""
        return bool(self._requests) and any(c.seq.params.return_routed_experts for c in plan.chunks)

    def record(self, plan: SchedulerOutput, handle: Any) -> None:
        """Copies the routing of a dispatched step (`handle`) of `plan` to the tables of
        its sequences that ask; a step whose sequences do not ask copies nothing."""
        if not self.wants(plan):
            return
        routing = self.runner.fetch_routing(handle).transpose(1, 0, 2)  # [T, L, k]
        row = 0
        for c in plan.chunks:
            entry = self._requests.get(c.seq.request_id)
            if entry is not None and entry[0][c.seq.index] is c.seq:
                tables = entry[1]
                end = c.start + c.num_tokens
                table = tables[c.seq.index]
                if end > len(table):  # grown geometrically: amortised O(1) per token
                    grown = self._empty(max(end, 2 * len(table)))
                    grown[: len(table)] = table
                    tables[c.seq.index] = table = grown
                table[c.start : end] = routing[row : row + c.num_tokens]
            row += c.num_tokens

    def attach(self, outputs: StepOutputs) -> StepOutputs:
        """`outputs`, each finished completion of a request that asks with its
        `routed_experts`; a finished request's tables are then dropped. Such requests'
        outputs are built on the step's thread (not `Request.deferred`), so this builds
        no other output."""
        if not self._requests:
            return outputs
        for out in outputs.built_items():
            entry = self._requests.get(out.request_id)
            if entry is None:
                continue
            seqs, tables, results = entry
            for completion in out.outputs:
                if completion.finish_reason is not None:
                    i = completion.index
                    if i not in results:
                        results[i] = self._result(seqs, tables, completion)
                    completion.routed_experts = results[i]
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _result(
        self, seqs: list[SequenceState], tables: list[np.ndarray], completion
    ) -> np.ndarray:
        """i32[N, L, k] of a finished completion's N = prompt + output tokens."""
        i = completion.index
        seq = seqs[i]
        if seq.params.output_kind is RequestOutputKind.DELTA:
            outputs = _real(seq.output_token_ids)
        else:
            outputs = completion.token_ids
        tokens = [*seq.prompt_token_ids, *outputs]
        n = len(tokens)
        result = self._empty(n)
        mine = tables[i][:n]
        result[: len(mine)] = mine
        for j, (other, table) in enumerate(zip(seqs, tables, strict=True)):
            if j == i:
                continue
            same = _common_prefix(tokens, [*other.prompt_token_ids, *_real(other.output_token_ids)])
            same = min(same, len(table))
            missing = np.nonzero((result[:same] == NOT_ROUTED).all(axis=(1, 2)))[0]
            result[missing] = table[missing]
        if outputs:  # the last generated token: never an input of the model
            result[n - 1] = NOT_ROUTED
        return result


def _real(tokens: list[int]) -> list[int]:
    """The tokens before the first placeholder (< 0) of an async step."""
    return list(itertools.takewhile(lambda t: t >= 0, tokens))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
