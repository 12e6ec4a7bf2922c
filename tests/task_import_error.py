"""A task module whose import fails, as a module with a bug would."""

raise RuntimeError("the task module itself is broken")
