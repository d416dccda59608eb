"""Helpers shared by the tests: bounded polls, child processes' ports, SSE frames."""
