"""The one refusal of the Anthropic translation: a request field the Messages API cannot carry (pure).

The broker refuses what it cannot carry rather than drop it silently: the caller gets a 400 naming the
field (`code: unsupported_parameter`) before anything is sent, and a pool offers the call to the model's
upstreams of other kinds first (`errors.UpstreamUnsupported`).
"""

from __future__ import annotations

from mergebroker.errors import UpstreamUnsupported


def refuse(param: str, why: str) -> UpstreamUnsupported:
    """The 400 for the request field `param` (a path such as `messages[2].content[0]`), saying `why`."""
    return UpstreamUnsupported(f"'{param}' is not supported by an Anthropic upstream: {why}.", param=param)
