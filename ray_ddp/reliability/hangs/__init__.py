"""Hangs, stragglers and data stalls: each rank's watchdog (``watchdog``), what a hung rank leaves
(``dump``), the line that names the stuck ranks (``report``), and the process group's and
NCCL's own timeouts (``settings``)."""
