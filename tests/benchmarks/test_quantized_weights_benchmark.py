"""The quantized-weights benchmark runs small: a layer's parameters halve in int8."""

from benchmarks import quantized_weights


def test_a_layers_parameters_halve_in_int8():
    bf16 = quantized_weights.per_layer("tiny", None)
    int8 = quantized_weights.per_layer("tiny", "int8")
    # The projections halve; a layer's two norms and the scales stay bfloat16.
    assert 0.5 < int8["param_bytes"] / bf16["param_bytes"] < 0.52
    assert int8["bytes"] > 0 and int8["flops"] > 0
