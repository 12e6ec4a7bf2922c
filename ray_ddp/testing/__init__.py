"""What tests ask of a real run, kept out of the user's configuration: faults to inject
and records to keep (:class:`~ray_ddp.testing.harness.Harness`). Never set by a flag,
never in ``TrainConfig``, ``--help``, ``ray_ddp_config.json`` or a checkpoint."""
