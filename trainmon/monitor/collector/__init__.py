"""The collector daemon: HTTP ingest, the writer, detection in a child process, anomaly lifecycle, exporter."""
