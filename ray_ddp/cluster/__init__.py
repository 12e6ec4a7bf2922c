"""The driver's view of the Ray cluster: connecting (``connect``), what is free where
(``resources``, ``placement``), asking the autoscaler for nodes (``autoscaling``), storage every
node sees (``shared_storage``)."""
