"""The worker pool of each audit event: what a tenant is shown instead of worker URLs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_events", sa.Column("pool", sa.String(100)))


def downgrade() -> None:
    op.drop_column("audit_events", "pool")
