"""The one place where the GPU kernels meet JAX APIs that differ across the supported range.

Supported: jax 0.10.2 to 0.12. The Pallas Triton API (`jax.experimental.pallas.triton`,
`plgpu.CompilerParams(num_warps=, num_stages=)`) is the same across that range; JAX 0.11
marks the Triton backend deprecated (a `DeprecationWarning` when a kernel is lowered for a
GPU) but keeps it. What differs is how a Triton kernel is lowered without a GPU present:
0.10 falls back to compute capability 9.0 by itself, while 0.11 and later need an abstract
GPU device on the abstract mesh to know which GPU to lower for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import jax
from jax.experimental.pallas import triton as plgpu

__all__ = ["TritonKernel", "plgpu", "triton_kernels", "triton_kernels_in", "triton_lowering_target"]


@contextlib.contextmanager
def triton_lowering_target(device_kind: str = "NVIDIA H200") -> Iterator[None]:
    """Lets `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` lower Triton kernels
    for the GPU named `device_kind` on a machine without one (0.10 ignores the name and
    lowers for compute capability 9.0, which an H100/H200 is). Make the arguments before
    entering: from 0.11, creating a concrete array under the abstract mesh is an error.
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_lowering",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


class TritonKernel(NamedTuple):
    """One Pallas kernel of a `cuda` lowering, as XLA would hand it to Triton."""

    name: str  # the pallas_call's name
    ir: str  # the Triton module (tt dialect) as MLIR text, verified
    num_warps: int
    num_stages: int


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """The Pallas kernels of a `cuda` lowering in program order, each with its Triton
    module (as MLIR text, parsed and verified with the Triton dialect's op verifiers) and
    the launch parameters XLA compiles it with; raises ValueError for a module that does
    not verify. Covers jaxlib 0.10.2+, whose Pallas lowering embeds the Triton IR in a
    `__gpu$xla.gpu.triton` custom call for XLA to compile.
    """
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    configs = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    attrs = child.operation.attributes
                    if (
                        child.operation.name == "stablehlo.custom_call"
                        and ir.StringAttr(attrs["call_target_name"]).value == "__gpu$xla.gpu.triton"
                    ):
                        configs.append(ir.DictAttr(attrs["mhlo.backend_config"]))
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    context = mlir.JaxIrContext()
    context.append_dialect_registry(mlir.upstream_dialects)
    tt_dialect.register_dialect(context)
    context.load_all_available_dialects()
    kernels = []
    with context:
        for config in configs:
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            if not module.operation.verify():
                raise ValueError(f"Triton module does not verify:\n{module}")
            kernels.append(
                TritonKernel(
                    name=ir.StringAttr(config["name"]).value,
                    ir=str(module),
                    num_warps=ir.IntegerAttr(config["num_warps"]).value,
                    num_stages=ir.IntegerAttr(config["num_stages"]).value,
                )
            )
    return kernels


def triton_kernels_in(lowered: jax.stages.Lowered) -> list[str]:
    """The Triton modules (as verified MLIR text) of the Pallas kernels in a `cuda`
    lowering: `triton_kernels` without the launch parameters."""
    return [kernel.ir for kernel in triton_kernels(lowered)]
