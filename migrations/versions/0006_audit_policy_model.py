"""The model of models.yaml each audit event's request resolved to: where a client named an
alias (``model``), the model that served it.

Revision ID: 0006
Revises: 0005 (the stored responses, added beside it)
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_events", sa.Column("policy_model", sa.String(200)))


def downgrade() -> None:
    op.drop_column("audit_events", "policy_model")
