"""Files and lines: storage (local paths and URIs, atomic writes), run logs, plots, what gets
printed, the run's timeline. No Ray, no training."""
