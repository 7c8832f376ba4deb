"""Mixtral and Qwen3-MoE: the MoE layer against loops, transformers' logits and routing,
greedy generation against transformers', the paged path against the dense oracle,
routing replay, the work per token, and config parsing."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import PROMPT_LEN, greedy, write_checkpoint
from test_gemma import check_engine_matches_dense
from test_models import check_paged_matches_dense, perturbed_model

from paxkv import LLM, SamplingParams
from paxkv.models import MoeConfig, load_hf_checkpoint, load_model, save_hf_checkpoint
from paxkv.models import moe as moe_layer
from paxkv.models.moe_config import MIXTRAL_8X7B, QWEN3_30B_A3B, TINY_MIXTRAL, TINY_QWEN3_MOE
from paxkv.planner import parameters

HI = jax.lax.Precision.HIGHEST
CONFIGS = {
    "mixtral": TINY_MIXTRAL,
    "mixtral-window": TINY_MIXTRAL.replace(sliding_window=8),
    "qwen3-moe": TINY_QWEN3_MOE,
    "qwen3-moe-unnormalised": TINY_QWEN3_MOE.replace(norm_topk_prob=False),
}


# The grouped matmul and the router, against loops.


def _loop_grouped_matmul(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    row = 0
    for g, size in enumerate(sizes):
        out[row : row + size] = lhs[row : row + size] @ rhs[g]
        row += size
    return out  # rows past the groups stay zero


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
@pytest.mark.parametrize(
    "sizes",
    [[3, 0, 5, 1], [0, 0, 9, 0], [1, 1, 1, 1], [2, 0, 0, 3], [0, 0, 0, 0], [9, 0, 0, 0]],
)
def test_grouped_matmul_matches_a_loop(impl, sizes):
    rng = np.random.default_rng(0)
    lhs = rng.standard_normal((9, 16))
    rhs = rng.standard_normal((4, 16, 8))
    got = moe_layer.grouped_matmul(
        jnp.asarray(lhs, jnp.float32),
        jnp.asarray(rhs, jnp.float32),
        jnp.asarray(sizes, jnp.int32),
        impl=impl,
        precision=HI,
    )
    np.testing.assert_allclose(got, _loop_grouped_matmul(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_tiled_grouped_matmul_on_many_groups():
    rng = np.random.default_rng(1)
    cases = [
        (r, g, rng.multinomial(r - 3, np.ones(g) / g)) for r, g in ((200, 7), (5, 64), (64, 3))
    ]
    # Every group one row past a whole tile (of 32): the most tiles these rows can take.
    cases.append((130, 4, np.array([33, 33, 33, 31])))
    for rows, groups, sizes in cases:  # rows past the groups: 3, or none
        lhs, rhs = rng.standard_normal((rows, 12)), rng.standard_normal((groups, 12, 5))
        got = moe_layer.tiled_grouped_matmul(
            jnp.asarray(lhs, jnp.float32),
            jnp.asarray(rhs, jnp.float32),
            jnp.asarray(sizes, jnp.int32),
            precision=HI,
        )
        want = _loop_grouped_matmul(lhs, rhs, sizes)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert not np.asarray(got[sizes.sum() :]).any()


def test_tile_rows_and_count():
    # A power of two at or above half the mean group, at least 8 rows (unless there are
    # fewer rows): a decode step's groups of a row or two take a tile each.
    cases = ((16, 8), (3, 8), (128, 4), (130, 4), (128, 64))
    assert [moe_layer.tile_rows(m, g) for m, g in cases] == [8, 4, 16, 32, 8]
    assert [moe_layer.num_tiles(m, g) for m, g in cases] == [9, 3, 11, 7, 72]


def test_route_by_hand():
    logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]])
    e = np.e
    weights, experts = moe_layer.route(logits, 2, renormalize=True)
    assert experts.tolist() == [[1, 2]]
    # Renormalised top-k probabilities are the softmax of the top-k logits.
    np.testing.assert_allclose(weights, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-6)
    probs = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    weights, _ = moe_layer.route(logits, 2, renormalize=False)
    np.testing.assert_allclose(weights, [probs[[1, 2]]], rtol=1e-6)
    # Replayed experts: the probabilities there, by the same rule.
    forced = jnp.asarray([[3, 0]])
    weights, experts = moe_layer.route(logits, 2, renormalize=True, experts=forced)
    assert experts.tolist() == [[3, 0]]
    np.testing.assert_allclose(weights, [[1 / (1 + e), e / (1 + e)]], rtol=1e-6)
    weights, _ = moe_layer.route(logits, 2, renormalize=False, experts=forced)
    np.testing.assert_allclose(weights, [probs[[3, 0]]], rtol=1e-6)


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
def test_expert_mlp_matches_a_token_loop(impl):
    rng = np.random.default_rng(2)
    t, h, i, e, k = 11, 16, 24, 6, 3
    x = rng.standard_normal((t, h))
    experts = np.stack([rng.permutation(e)[:k] for _ in range(t)])
    weights = rng.random((t, k))
    gate, up = rng.standard_normal((e, h, i)) / 4, rng.standard_normal((e, h, i)) / 4
    down = rng.standard_normal((e, i, h)) / 5
    silu = lambda v: v / (1 + np.exp(-v))

    def loop(first, count):
        out = np.zeros((t, h))
        for s in range(t):
            for j in range(k):
                ex = experts[s, j]
                if first <= ex < first + count:
                    y = (silu(x[s] @ gate[ex]) * (x[s] @ up[ex])) @ down[ex]
                    out[s] += weights[s, j] * y
        return out

    f32 = lambda a: jnp.asarray(a, jnp.float32)
    # All experts, and (as one device of an expert-parallel mesh holds) experts 2..4.
    for first, count in ((0, e), (2, 3)):
        got = moe_layer.expert_mlp(
            f32(x),
            jnp.asarray(experts, jnp.int32),
            f32(weights),
            (f32(gate[first : first + count]), f32(up[first : first + count])),
            f32(down[first : first + count]),
            first_expert=first,
            impl=impl,
            precision=HI,
        )
        np.testing.assert_allclose(got, loop(first, count), rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_by_hand():
    # Columns alternate gate, up: gate 9 is clamped to 7, up -8 to -7 and 8 to 7.
    gate_up = jnp.asarray([[9.0, -8.0, 1.0, 8.0]])
    got = moe_layer.clamped_swiglu(gate_up, limit=7.0, alpha=1.702)
    sig = lambda v: 1 / (1 + np.exp(-v))
    want = [[(-7 + 1) * 7 * sig(7 * 1.702), (7 + 1) * 1 * sig(1.702)]]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gpt_oss_block_matches_transformers():
    """gpt-oss's MoE block (a biased router, the fused and interleaved gate/up with
    biases, the clamped SwiGLU) against transformers' `GptOssMLP`, with weights large
    enough that the clamps bite."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    h, i, e, k = 64, 32, 8, 4
    hf = GptOssMLP(
        transformers.GptOssConfig(
            hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k
        )
    ).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.5 if "bias" in name else 3.0 / np.sqrt(p.shape[-1]))
    config = TINY_MIXTRAL.replace(
        hidden_size=h, intermediate_size=i, num_experts=e, num_experts_per_tok=k
    )
    block = moe_layer.MoE(
        config, moe_layer.ExpertForm.gpt_oss(limit=7.0, alpha=1.702), rngs=nnx.Rngs(0)
    )
    value = lambda t: jnp.asarray(t.detach().numpy())
    block.router.kernel.set_value(value(hf.router.weight).T)
    block.router.bias.set_value(value(hf.router.bias))
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        getattr(block.experts, name).set_value(value(getattr(hf.experts, name)))
    x = np.random.default_rng(8).standard_normal((1, 24, h)).astype(np.float32)
    with torch.no_grad():
        want, _ = hf(torch.tensor(x))
        gate_up = hf.experts.gate_up_proj.numpy()
    got, experts = block(jnp.asarray(x[0]))
    # Outputs reach ~15 and sum float32 terms of that size in another order than
    # torch's (which differs by CPU: 2.1e-5 off on an AVX2-only host): the absolute
    # tolerance scales with them; an indexing fault is off by O(1).
    want = want[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=4e-6 * np.abs(want).max())
    assert experts.shape == (24, k)
    # The clamps were in force: some token's gate or up went past the limit.
    pre = np.einsum("th,ehn->ten", x[0], gate_up)
    assert np.abs(pre).max() > 7.0


# Against transformers.


def _hf_router_choice(reference, tokens):
    """Transformers' top-k experts per layer and token, by its router logits."""
    import torch

    with torch.no_grad():
        out = reference(torch.tensor(tokens)[None], output_router_logits=True)
    return [torch.topk(r.float(), r.shape[-1], dim=-1).indices.numpy() for r in out.router_logits]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_routing_match_transformers(name, tmp_path):
    import torch

    config = CONFIGS[name]
    reference = write_checkpoint(config, tmp_path)
    loaded, model = load_hf_checkpoint(tmp_path)
    assert loaded == config
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, PROMPT_LEN)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)[None]).logits[0].numpy()
    got, routing = model.dense_logits(jnp.asarray(tokens, jnp.int32), return_routing=True)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-4)
    k = config.num_experts_per_tok
    ranked = _hf_router_choice(reference, tokens)
    for layer in range(config.num_layers):
        np.testing.assert_array_equal(np.asarray(routing[layer]), ranked[layer][:, :k])
    # The routing is not trivial: every expert serves some token.
    assert len(np.unique(np.asarray(routing))) == config.num_experts


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("name", ["mixtral-window", "qwen3-moe"])
def test_llm_greedy_matches_transformers(name, tmp_path):
    config = CONFIGS[name]
    reference = write_checkpoint(config, tmp_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, config.vocab_size, n).tolist() for n in (1, 9, 30)]
    expected = [greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(model=str(tmp_path), warmup=False, num_pages=64, page_size=8, max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


# The paged path against the dense oracle.


@pytest.mark.parametrize("name", ["mixtral-window", "qwen3-moe"])
def test_paged_prefill_and_decode_match_dense(name):
    check_paged_matches_dense(perturbed_model(CONFIGS[name]))


@pytest.mark.parametrize("name", ["mixtral-window", "qwen3-moe"])
def test_engine_greedy_matches_dense(name):
    # Uniform paging: with the window's pages given back the pool would not run short.
    check_engine_matches_dense(perturbed_model(CONFIGS[name]), hybrid_kv_cache=False)


def test_scanned_layers_match_the_loop():
    model = perturbed_model(TINY_QWEN3_MOE.replace(num_layers=3))
    from paxkv.models import layer_stack

    scanned = layer_stack.with_scan_layers(model, True)
    assert scanned.layers.blocks[0].mlp.experts.gate_proj.get_value().shape == (3, 16, 128, 64)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, 30), jnp.int32)
    want, routes = model.dense_logits(tokens, return_routing=True)
    got, scanned_routes = scanned.dense_logits(tokens, return_routing=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(scanned_routes, routes)


def test_checkpoints_round_trip_stacked_over_layers_and_experts(tmp_path):
    model = perturbed_model(TINY_MIXTRAL)
    # Shards of ~300 KB: one layer's experts lie in several files.
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=300_000)
    stats = {}
    config, stacked = load_hf_checkpoint(tmp_path, scan_layers=True, stats=stats)
    w2 = stacked.layers.blocks[0].block_sparse_moe.experts.w2.get_value()
    assert config.scan_layers and w2.shape == (2, 8, 128, 128)
    want = model.layers[1].block_sparse_moe.experts.w2.get_value()[5]
    np.testing.assert_array_equal(w2[1, 5], want)
    assert stats["model.layers.1.block_sparse_moe.experts.5.w2.weight"] == want.nbytes
    params = nnx.state(model, nnx.Param)
    assert stats["bytes_read"] == sum(v.get_value().nbytes for _, v in nnx.to_flat_state(params))


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
def test_grouped_matmuls_give_the_same_model(impl):
    model = perturbed_model(TINY_MIXTRAL)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, 24), jnp.int32)
    want = model.dense_logits(tokens)
    model = perturbed_model(TINY_MIXTRAL.replace(grouped_matmul=impl))
    got = model.dense_logits(tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


# Routing replay.


def test_routing_replay():
    model = perturbed_model(TINY_QWEN3_MOE)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, 20), jnp.int32)
    logits, routing = model.dense_logits(tokens, return_routing=True)
    assert routing.shape == (2, 20, 4) and routing.dtype == jnp.int32
    # Replaying the rollout's own routing gives the same forward pass, bit for bit.
    replayed, again = model.dense_logits(tokens, routing=routing, return_routing=True)
    np.testing.assert_array_equal(replayed, logits)
    np.testing.assert_array_equal(again, routing)
    # Another routing is obeyed: the forward pass follows it, and changes.
    other = (routing + 1) % TINY_QWEN3_MOE.num_experts
    forced, used = model.dense_logits(tokens, routing=other, return_routing=True)
    np.testing.assert_array_equal(used, other)
    assert np.abs(np.asarray(forced) - np.asarray(logits)).max() > 1e-2


def test_paged_step_returns_the_routing_of_its_rows():
    from paxkv.kv_cache import PagedKVCache
    from paxkv.measure.page_tables import page_table_from_host

    model = perturbed_model(TINY_MIXTRAL)
    tokens = np.random.default_rng(6).integers(0, 256, 13)
    _, dense_routing = model.dense_logits(jnp.asarray(tokens, jnp.int32), return_routing=True)
    cache = PagedKVCache.create(
        num_layers=2, num_pages=4, num_kv_heads=2, page_size=8, head_dim=64, dtype=jnp.float32
    )
    table = page_table_from_host([[1, 2]], [13], [13], page_size=8, max_num_seqs=1, pages_per_seq=2)
    positions = jnp.arange(13, dtype=jnp.int32)
    hidden, _, routing = model(
        jnp.asarray(tokens, jnp.int32),
        positions,
        cache,
        table,
        attention_backend="reference",
        return_routing=True,
    )
    np.testing.assert_array_equal(routing, dense_routing)
    replayed, _ = model(
        jnp.asarray(tokens, jnp.int32),
        positions,
        cache,
        table,
        attention_backend="reference",
        routing=routing,
    )
    np.testing.assert_array_equal(replayed, hidden)


# Work per token: the MoE block's FLOPs and bytes follow top-k, not the expert count.


def _traced_cost(fn, *args) -> tuple[int, int]:
    """FLOPs of every matmul and bytes of every dynamic slice (the tile loop's reads of
    an expert's matrix) in the program `fn` traces to, each loop's body counted as many
    times as it runs and a conditional by its costlier branch (XLA's cost analysis
    counts a loop's body once)."""

    def walk(jaxpr) -> tuple[int, int]:
        flops = nbytes = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                (contracting, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                out = eqn.outvars[0].aval.shape
                flops += 2 * math.prod(out) * math.prod(lhs[i] for i in contracting)
            elif name == "dynamic_slice":
                out = eqn.outvars[0].aval
                nbytes += math.prod(out.shape) * out.dtype.itemsize
            elif name == "scan":
                f, b = walk(eqn.params["jaxpr"].jaxpr)
                flops, nbytes = flops + eqn.params["length"] * f, nbytes + eqn.params["length"] * b
            elif name == "cond":
                f, b = max(walk(branch.jaxpr) for branch in eqn.params["branches"])
                flops, nbytes = flops + f, nbytes + b
            else:
                assert name not in ("while", "ragged_dot_general"), name
                for value in eqn.params.values():
                    if isinstance(value, jax.extend.core.ClosedJaxpr):
                        f, b = walk(value.jaxpr)
                        flops, nbytes = flops + f, nbytes + b
        return flops, nbytes

    return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def _moe_block(num_experts, top_k, impl):
    config = TINY_MIXTRAL.replace(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        hidden_size=64,
        intermediate_size=64,
        grouped_matmul=impl,
    )
    block = moe_layer.MoE(config, moe_layer.MIXTRAL, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(block)
    return (lambda state, x: nnx.merge(graphdef, state)(x)[0]), state


MATRIX_BYTES = 64 * 64 * 4  # one expert's projection in the blocks below


def test_moe_flops_and_bytes_follow_top_k():
    x = lambda rows: jnp.asarray(np.random.default_rng(7).standard_normal((rows, 64)), jnp.float32)
    for rows in (4, 64):  # a decode step's rows, and a prefill chunk's
        for top_k in (2, 4):
            active = 2 * rows * top_k * 3 * 64 * 64  # the k experts' matmuls
            work = {}
            for e in (4, 16, 64, 256):
                run, state = _moe_block(e, top_k, "tiled")
                flops, nbytes = _traced_cost(run, state, x(rows))
                router = 2 * rows * 64 * e
                work[e] = flops - router
                # The k experts' work, and at most 7 tile rows of padding to a row (one
                # 8-row tile for each of a decode step's rows): bounded by k, not E.
                assert active <= flops - router <= 8 * active, (rows, top_k, e)
                if rows * top_k <= e:  # a decode step reads only its rows' experts
                    assert nbytes == 3 * rows * top_k * MATRIX_BYTES
            # Once the experts outnumber the rows, more experts add no work.
            assert len({w for e, w in work.items() if e >= rows * top_k}) == 1, work
    # JAX's CPU lowering of ragged_dot multiplies every row by every expert (XLA's cost
    # analysis; there is no loop in it), which is why the CPU takes the tiled path.
    for e in (4, 16, 64):
        run, state = _moe_block(e, 2, "ragged_dot")
        flops = jax.jit(run).lower(state, x(64)).compile().cost_analysis()["flops"]
        assert flops >= e * 2 * 64 * 2 * 3 * 64 * 64


# Configs.

# config.json as published: mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B.
MIXTRAL_8X7B_HF = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    ("hf", "preset"),
    [(MIXTRAL_8X7B_HF, MIXTRAL_8X7B), (QWEN3_30B_A3B_HF, QWEN3_30B_A3B)],
    ids=["mixtral-8x7b", "qwen3-30b-a3b"],
)
def test_from_hf_parses_real_configs(hf, preset):
    assert MoeConfig.from_hf(hf) == preset
    assert MoeConfig.from_hf(json.loads(json.dumps(preset.to_hf()))) == preset


def test_planner_counts_the_published_sizes():
    # 46.7B parameters, 12.9B active (Mistral's figures); 30.5B and 3.3B (Qwen's).
    assert parameters.num_parameters(MIXTRAL_8X7B) == 46_702_792_704
    assert parameters.active_parameters(MIXTRAL_8X7B) == 12_879_925_248
    assert parameters.num_parameters(QWEN3_30B_A3B) == 30_532_122_624
    assert parameters.active_parameters(QWEN3_30B_A3B) == 3_353_032_704
    assert parameters.expert_parameters(QWEN3_30B_A3B) == 48 * 128 * 3 * 2048 * 768


@pytest.mark.parametrize(
    ("hf", "change", "match"),
    [
        (QWEN3_30B_A3B_HF, {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        (QWEN3_30B_A3B_HF, {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
        (QWEN3_30B_A3B_HF, {"use_sliding_window": True}, "use_sliding_window=True"),
        (QWEN3_30B_A3B_HF, {"num_experts": None}, "missing field 'num_experts'"),
        (MIXTRAL_8X7B_HF, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (MIXTRAL_8X7B_HF, {"rope_scaling": {"rope_type": "yarn"}}, "rope_type='yarn'"),
        (MIXTRAL_8X7B_HF, {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in"),
        (MIXTRAL_8X7B_HF, {"num_local_experts": 8.0}, "'num_local_experts' must be an integer"),
    ],
)
def test_from_hf_rejects_what_it_cannot_run(hf, change, match):
    with pytest.raises(ValueError, match=match):
        MoeConfig.from_hf({k: v for k, v in hf.items() if k not in change} | change)


def test_tiny_presets_come_with_the_byte_tokenizer():
    for name, preset in (("tiny-mixtral", TINY_MIXTRAL), ("tiny-qwen3-moe", TINY_QWEN3_MOE)):
        config, model, tokenizer = load_model(name)
        assert config is preset and tokenizer is not None
        assert type(model).__name__ == "MoeForCausalLM"
