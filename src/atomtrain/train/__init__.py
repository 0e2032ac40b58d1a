"""Training: the loop, its runners, checkpoints and metrics."""
