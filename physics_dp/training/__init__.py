"""Training utilities: logging, plots, metrics."""
