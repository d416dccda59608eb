"""The HTTP way in: the aiohttp app, routes, middleware, bodies, the listening server, connections, drain."""
