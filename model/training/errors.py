"""Training's own error, kept JAX-free so the CLI can catch it without loading JAX."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped and kept its last good checkpoint."""
