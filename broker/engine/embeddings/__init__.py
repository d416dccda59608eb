"""`/v1/embeddings` after validation: limits, then the batcher (cache, in-flight coalescing, window batching)."""
