"""The web UI, served by the api process (services/ui/app.py)."""
