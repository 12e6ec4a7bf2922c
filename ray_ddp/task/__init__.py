"""The Task interface: your model, data, loss and metrics (``interface``); a task's batches
(``batches``); finding a task by its ``package.module:Name`` spec (``loading``) and checking
it before Ray starts (``checks``)."""

from ray_ddp.task.batches import Batch, map_tensors
from ray_ddp.task.interface import Sum, Task

__all__ = ["Batch", "Sum", "Task", "map_tensors"]
