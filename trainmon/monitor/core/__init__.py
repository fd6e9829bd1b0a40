"""The daemon's lower layer: formatting, escaping, stack grouping, goodput and budget arithmetic.

Detectors, the collector, importers and analysis all import it; it imports none of them (only the
wire format, the schedules and FLOPs formulas beside it, and the store), so the layers read one way.
``tests/test_architecture.py`` holds the rule.
"""
