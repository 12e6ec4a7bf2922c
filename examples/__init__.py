"""Worked examples of ray_ddp tasks (``--task examples.<module>:<Name>``)."""
