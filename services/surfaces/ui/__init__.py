"""The web UI, served by the api process (services/surfaces/ui/app.py)."""
