"""Shared fixtures: a real collector on a free loopback port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainmon.monitor.config import CollectorConfig
from trainmon.monitor.web.server import Collector, ServerThread, create_app


@dataclass
class LiveCollector:
    url: str
    collector: Collector
    server: ServerThread

    def post(self, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + "/v1/events", data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (status, body)
        return json.loads(body)

    def stop(self) -> None:
        self.server.stop()
        self.collector.close()


def start_collector(db: Path, port: int = 0, **config: Any) -> LiveCollector:
    collector = Collector.open(CollectorConfig(db=str(db), **config))
    server = ServerThread(create_app(collector), "127.0.0.1", port)
    server.start()
    return LiveCollector(f"http://127.0.0.1:{server.port}", collector, server)


@pytest.fixture
def live_collector(tmp_path: Path) -> Iterator[LiveCollector]:
    lc = start_collector(tmp_path / "trainmon.sqlite")
    yield lc
    lc.stop()
