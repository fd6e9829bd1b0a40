"""The daemon side of trainmon; never imports torch, so the collector and the CLI start fast.

Data flows through the subpackages in this order:

- ``collector``: the HTTP server, the writer that commits batches, the detection process and the
  anomaly engine, the live state behind ``/metrics``;
- ``detectors``: one module per detection, behind the interface in ``detectors.base``;
- ``store``: the SQLAlchemy schema (SQLite or PostgreSQL), its migrations and read queries;
- ``notify``: webhooks, Slack and Alertmanager, with grouping, dedupe and retries;
- ``importers``: foreign logs (HF, TensorBoard, CSV, llm.c/nanoGPT text) into the same store;
- ``analysis``: what reads the store afterwards: post-mortem, report and plots, compare, status
  view, and the budget arithmetic.

``cli`` is the ``trainmon`` command, thin over these; ``config`` holds every setting.
"""
