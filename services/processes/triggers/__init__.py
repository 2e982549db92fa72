"""Run triggers: an organization's trigger graph, and the subscriber that starts followers' runs."""
