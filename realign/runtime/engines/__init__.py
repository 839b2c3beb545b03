"""Per-replica engines: train_step, inference and generate."""
