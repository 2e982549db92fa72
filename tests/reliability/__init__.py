"""Reliability suite (issue 5): chaos, concurrency, fuzzing, stateful and canary tests."""
