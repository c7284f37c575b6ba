"""The trainer: backends, data, checkpoints, metrics, faults."""
