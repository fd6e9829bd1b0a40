"""Per-layer rows keep the sampled instability precursors.

The trainer sends, on sampled steps, maps per attention module, linear layer or parameter group
(``attn_logit_max``, ``attn_entropy``, ``linear_out_rms``, ``group_update_ratio``,
``adam_eps_frac``) and the LM head's ``output_logz`` and ``output_logit_max`` (issue 28). The live
detectors saw them but the store did not keep them, so a restarted collector's replay, a
post-mortem and an export did not see what the live view saw. ``precursors`` holds them as sent
(``{field: value or map}``, non-finite values as the wire's strings); NULL on rows without them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26 15:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("layer_stats") as batch:
        batch.add_column(sa.Column("precursors", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("layer_stats") as batch:
        batch.drop_column("precursors")
