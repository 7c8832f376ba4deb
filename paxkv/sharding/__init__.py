"""Serving on a mesh: mesh shapes and their arithmetic (`mesh_shape`, no JAX), the
model dimensions they split (`model_shape`, no JAX), and the shardings of weights,
pages and the attention call (`shardings`)."""
