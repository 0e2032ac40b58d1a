"""Sharing the device: a scheduler that preempts training at sub-model boundaries, and the
inference service that uses it."""
