"""Streams remember which step fields their stored steps hold.

A reader that asks whether a rank's steps carry a step time, tokens or a phase time (the post-mortem's
summary, which sums them only then) had to scan every step of the rank for an answer of no: a W&B or HF
log carries none, and a million steps took 0.26 s to say so. The collector knows it as it stores them:
``step_fields`` is the sorted list of the step fields (the wire's names: ``loss``, ``tokens``,
``phases``...) that some step of the stream stored holds; NULL when the stream was stored before this
revision (unknown: readers scan then), and it stays NULL as such a stream goes on.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 14:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("streams") as batch:
        batch.add_column(sa.Column("step_fields", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("streams") as batch:
        batch.drop_column("step_fields")
