"""streamforge."""
