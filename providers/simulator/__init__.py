"""The simulated upstream: a real aiohttp server speaking OpenAI's, Anthropic's and Azure's APIs, with faults,
quiz mode and merged-call replies. It imports only the ground layer (`mergebroker.errors`, `clock`, ...)."""
