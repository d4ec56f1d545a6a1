"""The shared tier on an S3 bucket (AWS S3 or a store speaking its API), through
aiobotocore: requests are signed by botocore, never here.

Objects are ``<prefix>objects/<name>``, heads ``<prefix>heads/<name>``; a head's
compare-and-swap is a conditional write: ``If-Match`` on the ETag read, ``If-None-Match:
*`` for a first one, and a delete with ``If-Match``. Endpoint, region and credentials come
from the usual AWS settings (``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...). Files are sent in
parts of :data:`PART_BYTES`, each read in one of the tier's own threads (:class:`TierThreads`):
the event loop never reads a disk. A multipart upload that fails is aborted beside the
caller (bounded: the caller never waits on a hung store for it); one a killed server left
open is aborted by the sweep once ``lease_s`` old (:meth:`S3Tier.remove_partial`).
"""

from __future__ import annotations

import builtins

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from strata_auto_sessions.shared.tier import ConditionFailed, Head, Listed, SharedTierError, TierThreads

#: A file larger than this is sent as a multipart upload, in parts this size.
PART_BYTES = 32 * 1024 * 1024
_CONDITION_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


class S3Tier:
    """:class:`~strata_auto_sessions.shared.tier.SharedTier` on ``s3://bucket/prefix``."""

    def __init__(self, bucket: str, prefix: str = "", *, addressing_style: str = "auto",
                 timeout_s: float = 10.0, endpoint_url: str | None = None):
        try:
            from aiobotocore.session import get_session
        except ImportError:
            raise SharedTierError("an s3:// shared tier needs aiobotocore: pip install 'strata-auto-sessions[s3]'") \
                from None
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.where = f"s3://{bucket}/{self.prefix}"
        self._session = get_session()
        # Where it found its credentials, at INFO on every start: not a line of ours.
        logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
        self._endpoint_url = endpoint_url
        self._addressing_style = addressing_style
        self._timeout_s = timeout_s
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self.threads = TierThreads(self.where)
        #: Aborts of failed multipart uploads, under way beside their callers.
        self._aborts: set[asyncio.Task[None]] = set()

    async def _c(self) -> Any:
        if self._client is None:
            from botocore.config import Config

            stack = contextlib.AsyncExitStack()
            config = Config(s3={"addressing_style": self._addressing_style}, connect_timeout=self._timeout_s,
                            read_timeout=self._timeout_s, retries={"max_attempts": 2, "mode": "standard"})
            self._client = await stack.enter_async_context(self._session.create_client(
                "s3", endpoint_url=self._endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None, config=config))
            self._stack = stack
        return self._client

    def _object(self, name: str) -> str:
        return f"{self.prefix}objects/{name}"

    def _head_key(self, name: str) -> str:
        return f"{self.prefix}heads/{name}"

    # -- objects ------------------------------------------------------------

    async def put(self, name: str, source: Path) -> None:
        client = await self._c()
        size = await self.threads.run(lambda: source.stat().st_size)
        key = self._object(name)
        with _errors(name):
            if size <= PART_BYTES:
                body = await self.threads.run(source.read_bytes)
                await client.put_object(Bucket=self.bucket, Key=key, Body=body)
                return
            upload = await client.create_multipart_upload(Bucket=self.bucket, Key=key)
            try:
                parts = []
                for number, offset in enumerate(range(0, size, PART_BYTES), start=1):
                    chunk = await self.threads.run(_read_part, source, offset, PART_BYTES)
                    sent = await client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload["UploadId"],
                                                    PartNumber=number, Body=chunk)
                    parts.append({"ETag": sent["ETag"], "PartNumber": number})
                await client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload["UploadId"],
                                                       MultipartUpload={"Parts": parts})
            except BaseException:
                # Beside the caller: awaited here, on a hung store, the abort would hold a
                # caller that gave up (its timeout) as long as botocore's own retries.
                abort = asyncio.ensure_future(self._abort(key, upload["UploadId"]))
                self._aborts.add(abort)
                abort.add_done_callback(self._aborts.discard)
                raise

    async def _abort(self, key: str, upload_id: str) -> None:
        with contextlib.suppress(Exception):
            client = await self._c()
            await asyncio.wait_for(client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id),
                                   self._timeout_s)

    async def fetch(self, name: str, target: Path) -> int:
        client = await self._c()
        with _errors(name, missing=True):
            answer = await client.get_object(Bucket=self.bucket, Key=self._object(name))
            handle = await self.threads.run(_create_private, target)
            try:
                written = 0
                async with answer["Body"] as body:
                    while chunk := await body.read(4 * 1024 * 1024):
                        await self.threads.run(handle.write, chunk)
                        written += len(chunk)
                return written
            finally:
                await self.threads.run(handle.close)

    async def list(self, prefix: str) -> builtins.list[Listed]:
        client = await self._c()
        found = []
        start = self._object("")
        with _errors(prefix):
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self._object(prefix)):
                for item in page.get("Contents", []):
                    found.append(Listed(item["Key"][len(start):], item["Size"], item["LastModified"].timestamp()))
        return found

    async def delete(self, name: str) -> None:
        client = await self._c()
        with _errors(name):
            await client.delete_object(Bucket=self.bucket, Key=self._object(name))

    async def put_bytes(self, name: str, data: builtins.bytes) -> None:
        client = await self._c()
        with _errors(name):
            await client.put_object(Bucket=self.bucket, Key=self._object(name), Body=data)

    async def fetch_bytes(self, name: str) -> builtins.bytes:
        return await self._get(self._object(name), name)

    async def _get(self, key: str, name: str) -> builtins.bytes:
        client = await self._c()
        with _errors(name, missing=True):
            answer = await client.get_object(Bucket=self.bucket, Key=key)
            async with answer["Body"] as body:
                return bytes(await body.read())

    # -- blocks ---------------------------------------------------------------

    def _block(self, name: str) -> str:
        return f"{self.prefix}blocks/{name}"

    async def put_block(self, name: str, data: builtins.bytes) -> bool:
        """A conditional put (``If-None-Match: *``): a block is written once, never over."""
        client = await self._c()
        try:
            with _errors(name, conditional=True):
                await client.put_object(Bucket=self.bucket, Key=self._block(name), Body=data, IfNoneMatch="*")
        except ConditionFailed:
            return False
        return True

    async def fetch_block(self, name: str) -> builtins.bytes:
        return await self._get(self._block(name), name)

    async def blocks(self) -> builtins.list[Listed]:
        client = await self._c()
        found = []
        start = self._block("")
        with _errors("blocks"):
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=start):
                for item in page.get("Contents", []):
                    found.append(Listed(item["Key"][len(start):], item["Size"], item["LastModified"].timestamp()))
        return found

    async def delete_block(self, name: str) -> None:
        client = await self._c()
        with _errors(name):
            await client.delete_object(Bucket=self.bucket, Key=self._block(name))

    # -- heads ----------------------------------------------------------------

    async def head(self, name: str) -> tuple[Head, str] | None:
        client = await self._c()
        try:
            with _errors(name, missing=True):
                answer = await client.get_object(Bucket=self.bucket, Key=self._head_key(name))
                async with answer["Body"] as body:
                    data = await body.read()
        except FileNotFoundError:
            return None
        return Head.decode(data), answer["ETag"]

    async def heads(self, prefix: str) -> builtins.list[str]:
        client = await self._c()
        start = self._head_key("")
        names = []
        with _errors(prefix):
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self._head_key(prefix)):
                names += [item["Key"][len(start):] for item in page.get("Contents", [])]
        return names

    async def put_head(self, name: str, head: Head, expect: str | None) -> str:
        client = await self._c()
        condition = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
        with _errors(name, conditional=True):
            answer = await client.put_object(Bucket=self.bucket, Key=self._head_key(name), Body=head.encode(),
                                             ContentType="application/json", **condition)
        return str(answer["ETag"])

    async def delete_head(self, name: str, expect: str) -> None:
        client = await self._c()
        with _errors(name, conditional=True):
            await client.delete_object(Bucket=self.bucket, Key=self._head_key(name), IfMatch=expect)

    # -- what killed uploads left ---------------------------------------------------------

    async def remove_partial(self, older_than_s: float) -> int:
        """Abort the multipart uploads under the objects begun, and last sent a part, more
        than ``older_than_s`` ago: the server sending them died (the store keeps their
        parts until aborted)."""
        client = await self._c()
        now, aborted = time.time(), 0
        with _errors("multipart uploads"):
            paginator = client.get_paginator("list_multipart_uploads")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=self._object("")):
                for upload in page.get("Uploads", []):
                    if now - upload["Initiated"].timestamp() <= older_than_s:
                        continue
                    # Some stores answer a fixed date for Initiated (moto's server does):
                    # the newest part tells too.
                    parts = await client.list_parts(Bucket=self.bucket, Key=upload["Key"],
                                                    UploadId=upload["UploadId"])
                    if any(now - part["LastModified"].timestamp() <= older_than_s
                           for part in parts.get("Parts", [])):
                        continue
                    with contextlib.suppress(FileNotFoundError), _errors(upload["Key"], missing=True):
                        await client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                            UploadId=upload["UploadId"])
                    aborted += 1
        return aborted

    async def close(self) -> None:
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=self._timeout_s)
        self.threads.close()
        if self._stack is not None:
            stack, self._stack, self._client = self._stack, None, None
            await stack.aclose()


def _create_private(path: Path) -> Any:
    """``path`` opened for writing, 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _read_part(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(size)


@contextlib.contextmanager
def _errors(name: str, *, missing: bool = False, conditional: bool = False) -> Any:
    """botocore's errors as the contract's: a refused condition, a missing object, the store
    unreachable."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code == "NoSuchBucket":  # a 404 too, but not of the object: the store is not set up
            raise SharedTierError(f"{name}: NoSuchBucket: the bucket does not exist (create it first; "
                                  f"{error.get('Message') or 'the store said so'})") from None
        if conditional and (code in _CONDITION_CODES or status in ("412", "409")):
            raise ConditionFailed(f"{name}: {error.get('Message') or code}") from None
        if (missing or conditional) and (code in _MISSING_CODES or status == "404"):
            if conditional:  # If-Match on a head that is gone
                raise ConditionFailed(f"{name}: no head to replace") from None
            raise FileNotFoundError(name) from None
        raise SharedTierError(f"{name}: {code or status}: {error.get('Message', exc)}") from None
    except BotoCoreError as exc:
        raise SharedTierError(f"{name}: {exc}") from None
