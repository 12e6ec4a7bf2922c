"""What every Ray Train worker runs: the built-in loop (``loop``) over the run's parts
(``builtin_parts``) and an epoch's stages (``epoch``), the training step and the pass over
an epoch (``step``), what watches each step (``hooks``, built by ``watch`` for both loops),
the optimizer, LR schedule and step (``optim``), resuming (``resume``), reporting and
checkpointing (``report``), exact evaluation (``evaluate``), an own loop's handle
(``own_loop``). Never imports the driver's or the cluster's code."""
