"""Experiment trackers (``--tracking mlflow|wandb``): the run's params, metrics and
artifacts in MLflow or Weights & Biases, sent from a background thread that a slow or
stopped server never holds up. Used by rank 0 of the workers and by the driver."""
