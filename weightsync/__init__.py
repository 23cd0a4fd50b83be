"""weightsync."""
