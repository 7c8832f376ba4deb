"""What the apps measure and show on the engine: the load benchmark (paged against
contiguous allocation), the KV cache's quality, and the demo."""
