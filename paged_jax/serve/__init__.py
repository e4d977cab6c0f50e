"""An OpenAI-compatible HTTP server over one paged engine (`python -m paged_jax.serve`).

`protocol` (request bodies -> engine requests, 400s), `chat` (chat templates), `runner`
(one asyncio loop driving one Engine on one worker thread), `app` (the routes, metrics),
`__main__` (flags, checkpoint loading, uvicorn).
"""
