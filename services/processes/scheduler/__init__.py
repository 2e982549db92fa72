"""Admission and dispatch."""
