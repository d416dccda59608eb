"""Requests sent to an upstream in the inbound API's own form (Responses to a Responses upstream, Messages to
an Anthropic one): admitted, limited, queued by priority, failed over and accounted as chat requests are."""
