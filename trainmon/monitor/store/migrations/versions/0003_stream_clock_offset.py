"""Streams remember their producer's clock offset.

A trainer's clock can be far off the collector's; the collector estimates each stream's offset
(``trainmon.clock``) and keeps the stream's and the run's times on its own clock.
``clock_offset`` is that estimate in seconds (collector minus producer), kept so a restarted
collector goes on from it and a reader can see the skew; NULL when the stream never arrived live
(an import) or was stored before this revision.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26 15:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("streams") as batch:
        batch.add_column(sa.Column("clock_offset", sa.Float(precision=53), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("streams") as batch:
        batch.drop_column("clock_offset")
