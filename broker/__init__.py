"""mergebroker service: HTTP API, admission, queues, workers, settings, logging, CLI."""
