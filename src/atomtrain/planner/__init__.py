"""The planner: profiles a model on a device and partitions it into sub-models."""
