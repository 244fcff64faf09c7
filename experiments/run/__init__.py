"""One training run: settings, method registry, model, data, pure steps, loop, checkpoints."""
