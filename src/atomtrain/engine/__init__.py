"""The swap engine: a model larger than the device, streamed through it one sub-model at a time."""
