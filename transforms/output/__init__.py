"""The output: its folders and file names (``layout``), the Parquet schemas (``parquet``),
publishing a run (``manifest``, with the snapshots of previous outputs it checks) under a lease
(``lease``), compaction (``compaction``), the key index (``key_index``) and the checksums its
streaming key files are pinned by (``key_checksums``), and the readers of an output
(``current_vectors``)."""
