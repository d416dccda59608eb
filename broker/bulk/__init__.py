"""The Batch API without its transport: files, batches and their life cycle, the compacting runner, the store."""
