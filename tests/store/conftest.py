"""Fixtures of the storage tests: every store test runs on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures
from trainmon.monitor.store.storage import Storage


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    url = str(tmp_path / "db.sqlite") if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    storage = Storage(url)
    yield storage
    storage.close()
