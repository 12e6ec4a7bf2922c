"""Ray Train's log lines a run does not want."""

from __future__ import annotations

import logging


def quiet_report_lines() -> None:
    """Ray Train logs every ``report`` call at INFO from a logger named after its internal
    module's file path (outside ``ray.train``, so LoggingConfig's level does not reach it):
    two lines per epoch that would bury ours. That one logger is raised to WARNING; where
    the module is gone, nothing is done (the lines show)."""
    try:
        from ray.train.v2._internal.execution import context as train_context
    except ImportError:
        return
    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
