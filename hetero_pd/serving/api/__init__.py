"""The OpenAI-compatible front end: the aiohttp app, request parsing and validation,
response and SSE bodies, the edge session endpoint and its protocol."""
