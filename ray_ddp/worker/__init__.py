"""What every Ray Train worker runs: one object for its run (``run.WorkerRun``), the training step
and the pass over an epoch (``step``), what watches each step (``observers``), the optimizer and
LR schedule (``optim``), resuming (``resume``), reporting and checkpointing (``report``), exact
evaluation (``evaluate``). Never imports the driver's or the cluster's code."""
