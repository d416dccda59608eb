"""mergebroker: an OpenAI-compatible LLM request-merge broker.

This package is the ground layer (`errors`, `clock`); it imports nothing of ours. The layers above it are
sub-packages installed from the repository's top-level folders: `merge` and `breaker` on the ground,
`providers` on those, and `broker` (the service) on top.
"""
