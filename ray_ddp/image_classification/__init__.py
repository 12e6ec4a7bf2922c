"""The built-in task: image classification on the datasets of ``--dataset`` with the
models of ``--model`` (``task.ImageClassification``; its spec is
``ray_ddp.image_classification:ImageClassification``, as configs and checkpoints record it)."""

from ray_ddp.image_classification.task import ImageClassification

__all__ = ["ImageClassification"]
