"""Grafana dashboards as code: the JSON models (made by ``generate.py``) and their provisioning files.

Shipped inside the package as ``trainmon.dashboards`` so that ``trainmon grafana provision`` works
from an installed wheel, not only from a checkout."""
