"""Schedules: their commands and reads (`store`), and the loop that fires them (`loop`)."""
