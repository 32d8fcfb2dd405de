"""The models an API key may call, narrowing its tenant's (a JSON list; NULL: the tenant's).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("models", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("api_keys", "models")
