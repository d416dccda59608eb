"""The MCP way in: the broker's tools for agents (the official `mcp` SDK), embedded or over HTTP."""
