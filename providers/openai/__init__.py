"""OpenAI-compatible upstreams (and Azure's flavour): the HTTP provider and its Batch API."""
