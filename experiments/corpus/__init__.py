"""Text a run can train on without a download."""
