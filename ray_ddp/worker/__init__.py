"""What every Ray Train worker runs: one object for its run (``run.WorkerRun``), the training
step and the pass over an epoch (``step``), what watches each step (``hooks``, an own loop's
too), the optimizer, LR schedule and step (``optim``), resuming (``resume``), reporting and
checkpointing (``report``), exact evaluation (``evaluate``), an own loop's handle
(``own_loop``). Never imports the driver's or the cluster's code."""
