"""Streams remember which sequence numbers they stored, not only the highest.

A duplicate is an event already stored (same stream and seq). With only a high-water mark, an
event that arrived after a newer one (a retried batch after a timeout, a reversed batch) was
counted as a duplicate and never stored. ``received`` holds the stored seqs as sorted, disjoint,
inclusive ``[first, last]`` ranges (usually one); NULL on rows written before this revision means
"everything up to ``last_seq``", which is what they assumed.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24 16:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("streams") as batch:
        batch.add_column(sa.Column("received", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("streams") as batch:
        batch.drop_column("received")
