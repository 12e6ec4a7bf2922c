"""The Task interface: your model, data, loss and metrics (``interface``), and finding and
loading a task by its ``package.module:Name`` spec (``loading``)."""

from ray_ddp.task.interface import Batch, Sum, Task, map_tensors

__all__ = ["Batch", "Sum", "Task", "map_tensors"]
