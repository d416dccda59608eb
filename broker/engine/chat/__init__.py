"""The chat path after validation: the service (limits, cache, coalescing), jobs and the queue seam, merge
windows and workers, dispatch, early release and member streams, shadow comparison."""
