"""A worker's data: the order an epoch trains its samples in (``order``), the loaders over it
(``loaders``), streamed Parquet (``parquet_stream``), Ray Data (``ray_data``), every seed
(``seeding``) and unreadable samples (``unreadable``). Never imports the training loop."""
