"""The Anthropic Messages API as an upstream: translation both ways, replies, streams, errors."""
