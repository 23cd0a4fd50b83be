"""buffer."""
