"""ray_ddp: distributed PyTorch (DDP) training orchestrated by Ray Train.

Modules, one job each:
    config         the typed TrainConfig and its validation
    cli            command-line flags -> TrainConfig, exit codes
    trainer        the driver: preflight checks, Ray connection, TorchTrainer.fit, summary
    loop           the per-worker loop (DDP, AMP, accumulation, evaluation, checkpoints)
    loaders        DataLoaders with the right samplers, prepared by Ray
    datasets       datasets by name; synthetic_data and parquet_data for two of them
    models         models by name
    optim          optimizer and warm-up + cosine schedule
    precision      autocast and GradScaler
    evaluation     exact distributed evaluation
    checkpoint     checkpoint contents, atomic save, weights_only load
    comm_stats     counting gradient all-reduces
    reporting      what gets printed
"""

__version__ = "0.1.0"
