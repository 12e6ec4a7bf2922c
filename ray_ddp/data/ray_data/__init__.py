"""``--data-engine ray``: Ray Data reads and decodes, on the cluster's CPUs, and streams
batches into each training worker.

- ``driver``: nothing is built until Ray Train starts the workers: the trainer gets a
  builder per split (``SplitBuilder``, called by Ray Train's controller) and a ``Splits``
  data config (the training split cut into equal shares, the validation split into exact
  ones); the driver checks that the workers leave CPUs for Ray Data's tasks
  (``ray_ddp.cluster.resources.data_task_cpus``).
- ``decode``: a split is a small Ray Dataset of *items* (a Parquet split's row groups, an
  ImageFolder split's files: the same files, rows and labels the torch engine reads), then
  one ``map_batches`` that reads and decodes them with the task's decoder (``Decode``; the
  built-in task gives the torch engine's transforms); unreadable rows go to a named actor.
- ``worker``: a worker's shards become what the training step and evaluation take: a
  ``StreamOrder`` (an epoch order, ``ray_ddp.data.order.EpochOrder``) whose slots are made
  from the batches Ray delivers, a step at a time, and the loaders that yield them.

What holds in this mode (docs/data.md, "Ray Data engine", says it for users):

- every rank trains the same number of rows each epoch (``streaming_split(equal=True)``),
  so the same optimizer steps; the ``N mod world_size`` rows left over (and the
  unreadable ones) are not trained that epoch, and which ones varies;
- each training row at most once per epoch over all ranks; the step's gradient is the
  mean over its samples, whatever the last batch's size;
- the order is shuffled (row groups or files per epoch from ``--seed``, then a buffer of
  ``--shuffle-buffer`` rows) but not reproducible: Ray Data's tasks finish in any order,
  and so does augmentation's draw;
- evaluation is exact: every readable validation row on exactly one rank
  (``streaming_split(equal=False)``);
- a resume starts the epoch again from its first sample (``--checkpoint-every`` is
  refused), with the weights and optimizer of the checkpoint;
- an undecodable image is left out, named (``<file> row <n>``, or the file) in the run's
  ``bad_samples.csv`` and counted against ``--max-bad-samples`` (``ray_ddp.data.unreadable``):
  Ray Data's tasks hand the records to a small named actor (:class:`UnreadableRows`),
  rank 0 takes them at the end of each pass.
"""
