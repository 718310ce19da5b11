"""The output: its folders and file names (``layout``), the Parquet schemas (``parquet``),
publishing a run (``manifest``) under a lease (``lease``), compaction (``compaction``), the key
index (``key_index``), and the readers of an output (``current_vectors``)."""
