"""paxkv-serve: an OpenAI-compatible HTTP server over one `Engine`.

`frontend` drives the engine from one stepping thread for asyncio callers, `protocol`
is the OpenAI wire format, and `app` the Starlette app that joins them. The launch
script is `paxkv.launch.serve` (`paxkv-serve`); the HTTP stack is the `serve` extra.
"""
