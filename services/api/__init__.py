"""The HTTP API (aiohttp): see `services.api.app.build_app`."""
