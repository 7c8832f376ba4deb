"""paxkv: paged KV-cache attention for JAX.

Submodules load lazily, so the host core (`paxkv.host`) imports without pulling in JAX.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__version__ = "0.1.0"

_LAZY = {
    "PagedKVCache": "paxkv.kv_cache",
    "PageTable": "paxkv.kv_cache",
    "PagePool": "paxkv.host.page_pool",
    "NULL_PAGE": "paxkv.pallas_kernels.layout",
    "LLM": "paxkv.offline.llm",
    "Engine": "paxkv.engine.engine",
    "EngineConfig": "paxkv.engine.config",
    "SamplingParams": "paxkv.host.request",
    "RequestOutput": "paxkv.host.request",
    "RequestOutputKind": "paxkv.host.request",
    "LoRARequest": "paxkv.host.lora_slots",
}

# Import paths that moved in 0.1 -> where they are now. The old ones keep working, with
# a DeprecationWarning, for one release (docs/moved.md lists them).
MOVED = {
    "paxkv.llm": "paxkv.offline.llm",
    "paxkv.output_router": "paxkv.offline.call_mailboxes",
    "paxkv.progress": "paxkv.offline.progress",
    "paxkv.request": "paxkv.host.request",
    "paxkv.chat": "paxkv.text.chat",
    "paxkv.detokenizer": "paxkv.text.detokenizer",
    "paxkv.template_sandbox": "paxkv.text.template_sandbox",
    "paxkv.metrics": "paxkv.engine.metrics",
    "paxkv.configs": "paxkv.launch.setups",
    "paxkv.tools.capacity": "paxkv.planner.capacity",
    "paxkv.tools.capacity_report": "paxkv.planner.capacity_report",
    "paxkv.tools.kv_budget": "paxkv.planner.kv_budget",
    "paxkv.tools.parameters": "paxkv.planner.parameters",
    "paxkv.tools.workloads": "paxkv.planner.workloads",
    "paxkv.tools.load_bench": "paxkv.measure.load_bench",
    "paxkv.tools.reservations": "paxkv.measure.reservations",
    "paxkv.tools.bench_plot": "paxkv.measure.bench_plot",
    "paxkv.tools.quality": "paxkv.measure.kv_quality",
    "paxkv.tools.demo": "paxkv.measure.ragged_batch_demo",
    "paxkv.tools.page_tables": "paxkv.measure.page_tables",
    "paxkv.models.train": "paxkv.models.training",
    "paxkv.host.plan": "paxkv.host.step_plan",
    "paxkv.engine.step": "paxkv.engine.device.step",
    "paxkv.engine.sampling": "paxkv.engine.device.sampling",
    "paxkv.engine.spec_verify": "paxkv.engine.device.verification",
    "paxkv.engine.spec_accept": "paxkv.engine.device.acceptance",
    "paxkv.engine.draft": "paxkv.engine.device.draft",
    "paxkv.host.steady_decode": "paxkv.host.running_decodes",
}
_GONE_PACKAGES = {"paxkv.tools"}  # emptied: each module moved on its own


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of `MOVED` as the module at its new path (one module object
    under both names), warning once per import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED or fullname in _GONE_PACKAGES:
            return importlib.util.spec_from_loader(
                fullname, self, is_package=fullname in _GONE_PACKAGES
            )
        return None

    def create_module(self, spec):
        if spec.name in _GONE_PACKAGES:
            module = types.ModuleType(spec.name, f"Deprecated: see {MOVED}")
            module.__path__ = []
            return module
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=_caller_level(),
        )
        module = importlib.import_module(MOVED[spec.name])
        self._spec = module.__spec__  # import machinery overwrites it; exec_module restores
        return module

    def exec_module(self, module):
        if module.__name__ != module.__spec__.name:
            module.__spec__ = self._spec


def _caller_level() -> int:
    """The stack level of the first frame outside the import machinery."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_globals is globals()
    ):
        frame, level = frame.f_back, level + 1
    return level


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'paxkv' has no attribute {name!r}")


__all__ = sorted(_LAZY)
