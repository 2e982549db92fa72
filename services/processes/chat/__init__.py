"""Chat-ops: Slack slash commands and buttons that act by the core's rules."""
