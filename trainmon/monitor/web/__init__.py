"""The collector's HTTP face: the ingest and JSON API (``server``), the HTML pages (``pages``) and the
post-mortem served to a remote ``trainmon postmortem --url`` (``read_api``).

It sits above analysis (the pages and the read API render a run with it) and composes the collector's
pipeline, which sits below, so no layer imports one above it.
"""
