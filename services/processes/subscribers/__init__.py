"""Subscribers: handlers of the event log run by `runplane subscribers` (see host.py)."""
