"""The pure core of runplane: events, aggregates, decide / evolve. No I/O here."""
