"""The HTTP API (aiohttp): see `services.surfaces.api.app.build_app`."""
