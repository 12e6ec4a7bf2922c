"""The one door to Ray's private APIs (``ray._private``, ``ray._raylet``, ``ray.*._internal``).

ray_ddp needs a few things Ray has no public API for; every use of them is here, each with
the reason in one line, and nothing else in ray_ddp names them (``lint-imports`` and
``tests/test_architecture.py`` hold that). ``apis.py`` lists them, with the signatures they
had on the Ray versions they were verified on, for the fast test that fails in seconds,
naming the symbol, when a Ray upgrade moves one.

- ``versions``: the Ray releases the lean trainer was verified on; on any other, and with
  ``RAY_DDP_STOCK_TRAINER=1``, runs use Ray's stock ``TorchTrainer`` (said once, in one
  line): a newer Ray costs start-up time, never a broken run.
- ``lean_trainer``: Ray Train trimmed for a Ray this process started (no helper actors a
  local run does not use, a faster-polling controller in a pooled worker process).
- ``cluster_state``: what is free on each node, the node types a platform publishes, the
  autoscaling config the cluster's monitor was started with, whether Ray was started here.
- ``autoscaler``: asking the autoscaler for nodes through the coordinator Ray Train uses.
- ``train_logging``: quieting Ray Train's per-report log lines.
- ``checkpoint_upload``: an asynchronous checkpoint copied to storage by Ray's upload thread.
- ``notices``: whether the reclaim notice has reached this worker (for the test harness).

The others degrade where the installed Ray lacks what they use (each says so, once).
"""
