"""The optimizer a worker applies to the released noisy gradient, its parameter groups and
the learning-rate schedule."""
