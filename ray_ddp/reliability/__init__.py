"""What keeps a run going or stops it clearly: attempts (``attempts``), which failures a restart
can cure (``retry_policy``), the non-finite loss guard (``loss_guard``), hangs (``hangs``)."""
