"""The engine every way in shares: chat (queue, merging, dispatch), limits, embeddings, accounting, settings,
metrics and logging, built by `assemble`. It knows no transport: nothing here imports `aiohttp.web`."""
