"""Device code for paged attention: Pallas kernels, their references, and the KV write.

Nothing in this package knows about requests; it consumes int32 arrays, and it imports
nothing of the rest of paxkv. This file imports nothing either, so that the host core
reads the page format (`layout`: plain facts, no JAX) without loading JAX; import what
you use from its module:

- `dispatch`: `ragged_paged_attention` (one entry point, every backend), `BACKENDS`,
  `resolve_backend`;
- `reference`: `ragged_paged_attention_reference`, the oracle; `xla`:
  `ragged_paged_attention_xla`, the pure-JAX loop the CPU runs;
- `contract`: the shapes, validation and token layout every backend shares
  (`AttentionShapes`, `attention_inputs`, `attention_op`, `compute_dtype`);
- `kv_write`: `write_kv_pages`, `pack_kv_pages`; `quantization`: `quantize`, `dequantize`;
- `layout`: the page format (`NULL_PAGE`, KV dtype names, page geometry and bytes);
- `tpu/`, `gpu/`: the Mosaic and Triton kernels, loaded when a call picks them.
"""
