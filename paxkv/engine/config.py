"""Serving limits and step shapes of an engine, as one frozen dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any

from paxkv.host.batch import Buckets
from paxkv.host.request import MAX_SEED, check_bool, check_float, check_int
from paxkv.host.speculative import SpeculativeConfig
from paxkv.pallas_kernels.dispatch import BACKENDS, DETERMINISTIC, resolve_backend
from paxkv.pallas_kernels.layout import (
    KV_CACHE_DTYPES,
    MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
    cdiv,
    valid_page_size,
)


def _field(default, help: str, *, choices: tuple[str, ...] | None = None, ints: bool = False):
    """A field with a launch flag (`paxkv.launch.flags`): its help, its allowed values,
    or `ints` for a comma-separated list of integers."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "ints": ints}
    )


def _geometric(lo: int, hi: int, growth: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= growth
    return (*out, hi)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits and step shapes (see `buckets`)."""

    # Fields with a "help" are launch flags too (`paxkv.launch.flags`), with "choices"
    # as the flag's allowed values.
    num_pages: int = _field(1024, "KV pages of all layers (page 0 is reserved).")
    page_size: int = _field(16, "Tokens per KV page.")
    max_num_seqs: int = _field(32, "Sequences running at once.")
    max_num_batched_tokens: int = _field(512, "Tokens computed per step.")
    max_model_len: int = _field(2048, "Longest sequence, prompt and output.")
    kv_cache_dtype: str = _field(
        "auto", "KV page dtype; auto: the model dtype.", choices=KV_CACHE_DTYPES
    )
    attention_backend: str = _field("auto", "Attention implementation.", choices=BACKENDS)
    max_logprobs: int = _field(
        20, "Most top logprobs a request may ask for (SamplingParams.logprobs), as in vLLM."
    )
    # Most completions one request may ask for (SamplingParams.n); paxkv-serve sets it
    # from its --max_n, its limit at the door.
    max_n: int = 128
    hybrid_kv_cache: bool = _field(
        True,
        "For models with sliding-window layers: a page table per layer group, window "
        "groups holding only the pages inside their window (`paxkv.host.kv_groups`); "
        "off: uniform paging, one table, every layer keeps every page.",
    )
    deterministic: bool = _field(
        False,
        "Greedy and seeded outputs bitwise independent of batch-mates: one step shape "
        "(the largest bucket of each axis) and an attention reduction order from each "
        "sequence's own length (docs/python_api.md, 'Reproducible sampling').",
    )
    warmup_scoring: bool = _field(
        True,
        "Warm-up also compiles the sampler of scored prompt rows (prompt_logprobs, echo "
        "with logprobs, score requests) for each token bucket: a small program of the LM "
        "head; off: it compiles when first met.",
    )
    kv_host_cache_gib: float = _field(
        0.0,
        "Host memory (GiB) for KV pages the device prefix cache evicts; a prompt whose "
        "prefix continues there loads them back instead of prefilling (docs/host_kv_tier.md). "
        "0: off.",
    )
    enable_lora: bool = _field(
        False,
        "Serve LoRA adapters over the base model (docs/lora.md): requests name one "
        "(lora_request=, or the server's model field), max_loras of them on the device.",
    )
    max_loras: int = _field(1, "LoRA adapters on the device at once (enable_lora).")
    max_lora_rank: int = _field(16, "Largest LoRA rank served (enable_lora).")
    lora_method: str = _field(
        "auto",
        "How a step applies each row's adapter: per-row gathers (decode-sized steps) "
        "or a grouped matmul, jax.lax.ragged_dot (docs/lora.md).",
        choices=("auto", "gather", "ragged"),
    )
    seed: int = 0
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    log_stats_interval_s: float = 10.0  # a periodic absl log line; 0 turns it off
    # None: 8 on an accelerator, where it hides the host's time, and 1 on the CPU,
    # where host and "device" share cores (and with async scheduling).
    num_decode_steps: int | None = _field(
        None,
        "Decode steps per compiled call (`paxkv.engine.device.step.decode_loop`) when every "
        "scheduled sequence decodes without speculative proposals; unset: 8 on "
        "accelerators, 1 on CPU, with async scheduling or with speculative decoding.",
    )
    async_scheduling: bool = _field(
        False,
        "Schedule step k+1 while the device runs step k (`paxkv.engine.stepper`).",
    )
    # Speculative decoding (`paxkv.host.speculative`): a `SpeculativeConfig` or a dict of
    # its fields, as vLLM's `speculative_config`; None: off.
    speculative_config: SpeculativeConfig | None = None
    token_buckets: tuple[int, ...] | None = _field(
        None,
        "Packed-token sizes a step is padded to, ascending, the last max_num_batched_tokens; "
        "unset: from 16 growing by bucket_growth. One compiled program per (token, page) pair.",
        ints=True,
    )
    seq_buckets: tuple[int, ...] | None = _field(
        None,
        "Sequence counts a step is padded to, ascending; unset: tied to the token bucket.",
        ints=True,
    )
    page_buckets: tuple[int, ...] | None = _field(
        None,
        "Pages per sequence a step's block table is padded to, ascending, the last "
        "max_model_len / page_size; unset: from 8 growing by bucket_growth.",
        ints=True,
    )
    bucket_growth: int = 4

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), lo=1)
        check_int("max_model_len", self.max_model_len, lo=1)
        check_int("seed", self.seed, lo=0, hi=MAX_SEED)
        check_int("max_logprobs", self.max_logprobs, lo=0)
        check_int("max_n", self.max_n, lo=1)
        check_int("bucket_growth", self.bucket_growth, lo=2)
        if not valid_page_size(self.page_size):
            raise ValueError(
                f"page_size={self.page_size} must be a power of two in "
                f"[{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}] (what the kernels accept)"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}"
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} must be one of {BACKENDS}"
            )
        if not 0 <= check_float("watermark", self.watermark) < 1:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1)")
        if check_float("kv_host_cache_gib", self.kv_host_cache_gib) < 0:
            raise ValueError(f"kv_host_cache_gib={self.kv_host_cache_gib} must be >= 0")
        if self.kv_host_cache_gib and not self.enable_prefix_caching:
            raise ValueError(
                f"kv_host_cache_gib={self.kv_host_cache_gib} keeps pages of the prefix cache: "
                "it needs enable_prefix_caching=True"
            )
        if check_float("log_stats_interval_s", self.log_stats_interval_s) < 0:
            raise ValueError(f"log_stats_interval_s={self.log_stats_interval_s} must be >= 0")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("async_scheduling", self.async_scheduling)
        check_bool("hybrid_kv_cache", self.hybrid_kv_cache)
        check_bool("deterministic", self.deterministic)
        check_bool("warmup_scoring", self.warmup_scoring)
        check_bool("enable_lora", self.enable_lora)
        check_int("max_loras", self.max_loras, lo=1)
        check_int("max_lora_rank", self.max_lora_rank, lo=1)
        if self.lora_method not in ("auto", "gather", "ragged"):
            raise ValueError(
                f"lora_method={self.lora_method!r} must be 'auto', 'gather' or 'ragged'"
            )
        for name in ("token_buckets", "seq_buckets", "page_buckets"):
            sizes = getattr(self, name)
            if sizes is not None:
                for i, b in enumerate(sizes):
                    check_int(f"{name}[{i}]", b, lo=1)
        if self.seq_buckets and max(self.seq_buckets) > self.max_num_seqs:
            raise ValueError(
                f"seq_buckets={tuple(self.seq_buckets)} holds a size over "
                f"max_num_seqs={self.max_num_seqs}: a step never has more sequences"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}, so every running sequence can decode each step"
            )
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be at least 2 (page 0 is reserved)")
        if self.num_decode_steps is not None:
            check_int("num_decode_steps", self.num_decode_steps, lo=1)
        spec = SpeculativeConfig.of(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is not None and spec.method == "ngram" and self.async_scheduling:
            raise ValueError(
                "speculative_config method 'ngram' cannot be used with async_scheduling=True: "
                "its proposals are looked up on the host in the tokens the step before "
                "accepted, which async scheduling has not read when it plans the next step; "
                "use method 'draft_model' (proposed on the device) or async_scheduling=False"
            )

    def check_serves(self, model_config: Any, platform: str) -> None:
        """Raises ValueError if these settings cannot serve a model of `model_config`
        (its `max_position_embeddings`, if it has one) on `platform` ("cpu", "gpu", "tpu")."""
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        vocab = getattr(model_config, "vocab_size", None)
        if vocab is not None and self.max_logprobs > vocab:
            raise ValueError(
                f"max_logprobs={self.max_logprobs} exceeds the model's vocab_size={vocab}"
            )
        backend = self.attention_backend
        if backend in ("tpu", "gpu") and backend != resolve_backend("auto", platform):
            raise ValueError(
                f"attention_backend={backend!r} needs a {backend.upper()}; "
                f"this platform is {platform!r}"
            )

    def for_backend(self, backend: str) -> EngineConfig:
        """This config with `num_decode_steps` decided for `backend` ("cpu", "gpu", "tpu"):
        1 with speculative decoding, whose steps emit several tokens already."""
        if self.num_decode_steps is not None:
            return self
        one = backend == "cpu" or self.async_scheduling or self.speculative_config is not None
        return dataclasses.replace(self, num_decode_steps=1 if one else 8)

    @property
    def pages_per_seq(self) -> int:
        """Block-table entries of the longest sequence."""
        return cdiv(self.max_model_len, self.page_size)

    @property
    def step_attention_backend(self) -> str:
        """The backend the steps pass the model: `attention_backend`, asking for the
        batch-invariant reduction order when `deterministic`."""
        return self.attention_backend + (DETERMINISTIC if self.deterministic else "")

    def buckets(self) -> Buckets:
        """The step shapes: each list grows by `bucket_growth` and ends at its limit.

        `seq_buckets=None` ties the sequence count to the token bucket. `deterministic`
        keeps only the largest bucket of each axis: XLA's matmuls round a row
        differently at different row counts (measured on the CPU, f32: up to 2e-5 in a
        [M, 128] x [128, 512] dot between M = 4 and 64), so every step has one shape.
        """
        if self.deterministic:
            return Buckets(
                (self.max_num_batched_tokens,),
                (self.max_num_seqs,),
                (self.pages_per_seq,),
                self.max_num_seqs,
            )
        g = self.bucket_growth
        tokens = self.token_buckets or _geometric(
            min(16, self.max_num_batched_tokens), self.max_num_batched_tokens, g
        )
        pages = self.page_buckets or _geometric(min(8, self.pages_per_seq), self.pages_per_seq, g)
        return Buckets(
            tuple(tokens), tuple(self.seq_buckets or ()), tuple(pages), self.max_num_seqs
        )
