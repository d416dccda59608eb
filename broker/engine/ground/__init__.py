"""The engine's shared ground: settings and their loading, metrics, token counting, logging, request schemas, stored responses."""
