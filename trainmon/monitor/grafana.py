"""Upload the trainmon dashboards to a Grafana server (``trainmon grafana provision``).

For users whose Grafana is not provisioned from files (dashboards/provisioning/): the same JSON
goes through Grafana's HTTP API with grafana-client, into a folder, overwriting the previous
version so that re-running the command is how dashboards are updated. The API token is a
secret: it is only handed to the HTTP client, never printed or logged.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_client import GrafanaApi

from trainmon import dashboards

__all__ = [
    "DASHBOARD_DIR",
    "DASHBOARD_FILES",
    "ProvisionResult",
    "load_dashboards",
    "mask_secret",
    "provision",
    "provision_command",
]

DASHBOARD_DIR = Path(dashboards.__file__).resolve().parent
"""The dashboards' folder (``trainmon.dashboards``: the repository's dashboards/, or its copy in a wheel)."""
DASHBOARD_FILES = ("trainmon-run.json", "trainmon-fleet.json")
DATASOURCE_INPUT = "${DS_PROMETHEUS}"
"""The dashboards' import input (``__inputs``): the default of their ``datasource`` variable."""


@dataclass
class ProvisionResult:
    folder_uid: str
    folder_created: bool
    dashboards: list[dict[str, Any]]  # Grafana's answer per dashboard: uid, url, version, status


def _set_datasource(node: Any, uid: str) -> Any:
    """Fill the import input with ``uid``, as Grafana's import dialog does (the upload API does not):
    the dashboards' ``datasource`` variable then defaults to that Prometheus."""
    if isinstance(node, str):
        return node.replace(DATASOURCE_INPUT, uid)
    if isinstance(node, dict):
        return {k: _set_datasource(v, uid) for k, v in node.items()}
    if isinstance(node, list):
        return [_set_datasource(v, uid) for v in node]
    return node


def load_dashboards(directory: Path = DASHBOARD_DIR, datasource_uid: str | None = None) -> list[dict[str, Any]]:
    """The dashboards' JSON models, optionally defaulting to the Prometheus datasource ``datasource_uid``
    (without it Grafana picks its first Prometheus datasource)."""
    out = []
    for name in DASHBOARD_FILES:
        model = json.loads((directory / name).read_text(encoding="utf-8"))
        if datasource_uid:
            model = _set_datasource(model, datasource_uid)
        out.append(model)
    return out


def _folder_uid(title: str) -> str:
    """A stable uid from the folder name, so that two runs of the command find the same folder."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", title.strip().lower()).strip("-")[:40] or "trainmon"


def provision(
    url: str,
    token: str,
    folder: str = "trainmon",
    *,
    datasource_uid: str | None = None,
    directory: Path = DASHBOARD_DIR,
    timeout: float = 10.0,
    api: Callable[..., GrafanaApi] = GrafanaApi.from_url,
) -> ProvisionResult:
    """Create ``folder`` if it does not exist and upload both dashboards into it, overwriting."""
    dashboards = load_dashboards(directory, datasource_uid)
    grafana = api(url=url, credential=token, timeout=timeout)
    existing = next((f for f in grafana.folder.get_all_folders() if f.get("title") == folder), None)
    if existing is not None:
        uid, created = existing["uid"], False
    else:
        uid, created = grafana.folder.create_folder(folder, uid=_folder_uid(folder))["uid"], True
    answers = []
    for model in dashboards:
        answers.append(
            grafana.dashboard.update_dashboard(
                {
                    "dashboard": {**model, "id": None},  # id is per-server; the uid identifies it
                    "folderUid": uid,
                    "overwrite": True,
                    "message": "trainmon grafana provision",
                }
            )
        )
    return ProvisionResult(uid, created, answers)


def mask_secret(text: str, secret: str) -> str:
    """``text`` with ``secret`` replaced by ``***`` wherever it is the secret, not a piece of a word.

    A plain replace of a short secret blanks every matching piece of other words: the token ``x``
    turned "Max retries exceeded" into "Ma*** retries e***ceeded". A secret of 8 characters or more
    does not occur by chance, so every occurrence goes (glued to other text too, as in a
    percent-encoded ``token%3D...``); a shorter one only where it stands alone, between characters
    that cannot be part of it (an ``=``, a space, a quote, a slash).
    """
    if len(secret) >= 8:
        return text.replace(secret, "***")
    part = r"[A-Za-z0-9_.~+-]"  # what tokens are made of (base64url, hex, Grafana's glsa_...)
    return re.sub(rf"(?<!{part}){re.escape(secret)}(?!{part})", "***", text)


def provision_command(
    url: str, token: str | None, folder: str, datasource_uid: str | None = None, dashboards: str | None = None
) -> int:
    """``trainmon grafana provision``: the token from ``--token`` or ``$GRAFANA_TOKEN``; prints what
    was uploaded, never the token (not even inside an error message)."""
    token = token or os.environ.get("GRAFANA_TOKEN")
    if not token:
        print("trainmon grafana provision: give --token or set GRAFANA_TOKEN", file=sys.stderr)
        return 2
    directory = Path(dashboards) if dashboards else DASHBOARD_DIR
    try:
        result = provision(url, token, folder, datasource_uid=datasource_uid, directory=directory)
    except Exception as exc:  # a short report, not a traceback: the user fixes the URL, token or server
        message = mask_secret(f"{type(exc).__name__}: {exc}", token)
        print(f"trainmon grafana provision: {message}", file=sys.stderr)
        return 1
    verb = "created" if result.folder_created else "existing"
    print(f"folder {folder!r} ({verb}, uid {result.folder_uid})")
    for answer in result.dashboards:
        print(f"dashboard {answer.get('uid')}: {answer.get('status', 'success')} {answer.get('url', '')}".rstrip())
    return 0
