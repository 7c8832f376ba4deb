"""Serving on a mesh: mesh shapes and their arithmetic (`mesh_shape`, no JAX), and the
shardings of weights, pages and the attention call (`shardings`). A model's config is
read by field name (below the models, this layer knows no config class)."""
