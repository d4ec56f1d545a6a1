"""The shared tiers the tests run against: a directory, and a real S3 API server (moto's,
standalone, on loopback) started by the tests' conftest."""

from __future__ import annotations

import uuid
from typing import Any

from strata_auto_sessions.shared import DirectoryTier, S3Tier, SharedTier

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


async def new_bucket(endpoint: str) -> str:
    from aiobotocore.session import get_session

    bucket = f"strata-{uuid.uuid4().hex[:12]}"
    async with get_session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                           aws_access_key_id="testing", aws_secret_access_key="testing") as client:
        await client.create_bucket(Bucket=bucket)
    return bucket


async def make_tier(kind: str, tmp_path: Any, endpoint: str) -> SharedTier:
    if kind == "directory":
        root = tmp_path / f"shared-{uuid.uuid4().hex[:6]}"
        root.mkdir()
        return DirectoryTier(root)
    return S3Tier(await new_bucket(endpoint), "strata/prefix", endpoint_url=endpoint)
