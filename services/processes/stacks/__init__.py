"""The stack-run process: creates a stack run's child runs by DAG level and records their
ends (events/stack_runs.py)."""
