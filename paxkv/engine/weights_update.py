"""New weights for a running engine, in place: what the requests in flight do, the
swap between steps, and the weight version.

`paxkv.engine.params.prepare_params` checks and places the new tree; `WeightUpdater`
decides what the requests in flight do (`POLICIES`), swaps the parameters between steps
and bumps the weight version, which the prefix-cache keys and every `RequestOutput`
carry. The KV pool stays allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paxkv.engine.params import prepare_params, with_params_of
from paxkv.engine.requests import RequestRegistry
from paxkv.engine.runner import StepRunner
from paxkv.engine.stepper import Stepper
from paxkv.host.request import RequestOutput
from paxkv.host.scheduler import Scheduler

# What happens to the requests in flight when new weights arrive:
#   "wait": no new request is admitted; those already admitted (a completion scheduled
#     at least once, preempted ones included) finish under the old weights, then the
#     weights are swapped and the queued ones start under the new weights.
#   "abort": every unfinished request ends now, finish reason "abort", `error` saying why.
#   "recompute": running sequences are preempted and recompute their K/V under the new
#     weights; the tokens they sampled already stay.
POLICIES = ("wait", "abort", "recompute")


def _started(requests: RequestRegistry) -> set[str]:
    """Ids of the unfinished requests a completion of which has been scheduled."""
    return {
        req.request_id
        for req in requests.unfinished()
        if any(s.first_scheduled_time is not None for s in req.seqs)
    }


class WeightUpdater:
    """An engine's weight version and the one update that may run at a time.

    Args:
      runner: holds the parameters (`param_source`, `params`).
      scheduler: preempts for "recompute" and holds the queue "wait" holds back.
      requests: the engine's requests, told each new version.
      stepper: the engine's stepping loop, whose step in flight is read first.
      end_request: aborts a request with a reason (`Endings.end`).
      step: runs one engine step ("wait" steps until the started requests finish).
      has_unfinished: whether the engine has requests left.
      defer: hands outputs of the steps an update ran to the engine's next `step`.
    """

    def __init__(
        self,
        runner: StepRunner,
        scheduler: Scheduler,
        requests: RequestRegistry,
        stepper: Stepper,
        *,
        end_request: Callable[[str, str], object],
        step: Callable[[], list[RequestOutput]],
        has_unfinished: Callable[[], bool],
        defer: Callable[[list[RequestOutput]], None],
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.requests = requests
        self.stepper = stepper
        self.end_request = end_request
        self.step = step
        self.has_unfinished = has_unfinished
        self.defer = defer
        self.version = 0
        self.updating = False

    def prepare(self, weights: Any, *, policy: str = "wait", copy: bool = True) -> Any:
        """`weights` checked and placed as the runner's parameters (see
        `Engine.update_weights`), touching nothing of the engine: what `install` takes."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
        runner = self.runner
        source = getattr(runner, "param_source", None)
        if source is None:
            raise ValueError(f"{type(runner).__name__} holds no weights to update")
        return prepare_params(runner.params, source, weights, copy=copy)

    def install(self, new_params: Any, policy: str, paused: bool = False) -> int:
        """Installs parameters from `prepare`, handling the requests in flight as
        `policy` says; returns the new version."""
        runner = self.runner
        if self.updating:
            raise ValueError("another update_weights is running: one update at a time")
        if paused and policy == "wait" and _started(self.requests):
            raise ValueError(
                "update_weights(policy='wait') on a paused engine with requests in flight "
                "would never return (they cannot finish while paused): resume() first, or "
                "use policy='abort' or 'recompute'"
            )
        self.updating = True
        reported: list[RequestOutput] = []
        try:
            reported += self.stepper.drain()  # the step in flight ran under the old weights
            if policy == "wait":
                reported += self._finish_in_flight()
            elif policy == "abort":
                why = (
                    f"aborted by update_weights(policy='abort') (weight version {self.version + 1})"
                )
                for req in self.requests.unfinished():
                    self.end_request(req.request_id, why)
            else:
                self.scheduler.preempt_all()
            # The Param leaves only: the runner's other state (LoRA slots a step in
            # between may have written) is taken as it is now.
            runner.params = with_params_of(runner.params, new_params)
            self.version += 1
            self.scheduler.kv_cache_manager.set_weight_version(self.version)
            self.requests.set_weight_version(self.version)
        finally:
            self.updating = False
            self.defer(reported)  # the next `step` reports them
        return self.version

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Steps until the started requests have finished, the others held back in the
        queue (in order); returns what those steps reported."""
        waiting = self.scheduler.waiting
        started = _started(self.requests)
        held = [s for s in waiting if s.request_id not in started]
        for s in held:
            waiting.remove(s)
        reported: list[RequestOutput] = []
        try:
            while self.has_unfinished():
                reported += self.step()
        finally:
            waiting.extendleft(reversed(held))
        return reported
