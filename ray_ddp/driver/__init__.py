"""What runs in the process that starts a job: the entry points (``cli``), the checks before Ray
(``preflight``, ``prepare``), a run's TorchTrainer (``trainer``, ``run``), elastic worker
counts (``elastic``), sweeps (``tune``, ``sweep_results``), evaluation and export."""
