"""The S3 client: boto3 (botocore) does the credential chain (environment, profiles, SSO, instance and container
roles), request signing, the endpoint (AWS_ENDPOINT_URL) and the retries of failed requests (its "standard" mode:
exponential backoff with jitter, at most MAX_ATTEMPTS tries, each retry counted in RetryAttempts). What botocore
does not retry is a body cut after the headers (a reset connection, a short body): it raises, and get_into asks
again for the bytes still missing, with the same If-Match, at most MAX_ATTEMPTS times (BENCHMARKS.md, "Object
storage": why this client).

Errors become one CheckpointError naming the URL, the cause and the fix; the credentials in use are scrubbed
from every message (redact).
"""

from __future__ import annotations

import logging
import threading

from distload.errors import CheckpointError

from .url import ObjectUrl, ObjectVersion

MAX_ATTEMPTS = 5           # one try and up to 4 retries, for a request and for a body cut short
BODY_CHUNK = 1 << 20       # one readinto: urllib3 stages this much per stream in flight
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10, 60
EXTRA = "pip install 'distload[s3]'"


class ObjectChanged(CheckpointError):
    """An object's ETag is no longer the one planned (If-Match failed): it was overwritten during the load."""


def import_boto3():
    try:
        import boto3
        import botocore.config
    except ImportError as e:
        raise CheckpointError(f"s3:// checkpoints need distload's s3 extra (boto3, not installed here: {e.name}): "
                              f"{EXTRA}") from None
    for name in ("boto3", "botocore"):   # their INFO lines (where credentials were found) are not the load's news
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).getEffectiveLevel()))
    return boto3, botocore.config


class Store:
    """One process's client of the bucket of `url`, with its request and retry counts."""

    def __init__(self, url: ObjectUrl, connections: int = 16):
        boto3, config = import_boto3()
        self.url = url
        session = boto3.session.Session()
        credentials = session.get_credentials()
        if credentials is None:
            raise CheckpointError(f"{url}: no AWS credentials found (environment, AWS_PROFILE / ~/.aws, SSO, "
                                  f"instance or container role); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                  f"or AWS_PROFILE, for an identity that may read the bucket")
        frozen = credentials.get_frozen_credentials()
        self.secrets = tuple(s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s)
        self.client = session.client("s3", config=config.Config(
            retries={"mode": "standard", "max_attempts": MAX_ATTEMPTS}, max_pool_connections=connections,
            connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S, user_agent_extra="distload"))
        self.endpoint = self.client.meta.endpoint_url
        self.requests = self.retries = 0
        self._lock = threading.Lock()

    def count(self, response: dict, extra_retries: int = 0) -> None:
        tries = response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + extra_retries
        with self._lock:
            self.requests += 1 + tries
            self.retries += tries

    def listing(self) -> dict[str, ObjectVersion]:
        """The objects directly under the prefix (not in "sub-folders"), by file name."""
        prefix = f"{self.url.prefix}/" if self.url.prefix else ""
        found = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.url.bucket, Prefix=prefix,
                                                                              Delimiter="/"):
                self.count(page)
                for item in page.get("Contents", []):
                    found[self.url.name_of(item["Key"])] = ObjectVersion(item["Key"], item["Size"], item["ETag"])
        except Exception as exc:
            raise self.explain(exc, str(self.url), "list") from None
        return found

    def head(self, key: str) -> ObjectVersion | None:
        """The object's version now (None: there is none)."""
        try:
            response = self.client.head_object(Bucket=self.url.bucket, Key=key)
        except Exception as exc:
            if status_of(exc) == 404:
                return None
            raise self.explain(exc, f"s3://{self.url.bucket}/{key}", "read") from None
        self.count(response)
        return ObjectVersion(key, response["ContentLength"], response["ETag"])

    def get_into(self, obj: ObjectVersion, start: int, views: list[memoryview]) -> None:
        """Fill `views` (in order) with the object's bytes from `start`, all from its planned ETag."""
        cursor, cuts = BodyCursor(views), 0
        while True:
            response = self._get(obj, start + cursor.done, cursor.total - cursor.done)
            self.count(response)
            try:
                cursor.read(response["Body"])
                return
            except Exception as exc:
                if not is_cut_body(exc):
                    raise
                cuts += 1
                if cuts >= MAX_ATTEMPTS:
                    raise CheckpointError(redact(
                        f"s3://{self.url.bucket}/{obj.key}: the body of bytes {start}-{start + cursor.total - 1} "
                        f"broke off {cuts} times ({type(exc).__name__}: {exc}); nothing short was kept: check the "
                        f"network to {self.endpoint} and load again", self.secrets)) from None
                with self._lock:   # asking for the rest is a retry
                    self.retries += 1

    def _get(self, obj: ObjectVersion, start: int, n: int) -> dict:
        try:
            response = self.client.get_object(Bucket=self.url.bucket, Key=obj.key, IfMatch=obj.etag,
                                              Range=f"bytes={start}-{start + n - 1}")
        except Exception as exc:
            if status_of(exc) is not None:   # an answer, after botocore's retries: count them
                self.count(exc.response)
            raise self.explain(exc, f"s3://{self.url.bucket}/{obj.key}", "read", obj) from exc
        got = response.get("ContentRange", "")
        if not got.startswith(f"bytes {start}-") and not (start == 0 and response.get("ContentLength") == n):
            response["Body"].close()
            raise CheckpointError(f"s3://{self.url.bucket}/{obj.key}: asked for bytes {start}-{start + n - 1}, the "
                                  f"endpoint {self.endpoint} answered {got or 'the whole object'}: it must serve "
                                  f"ranged GETs (Range: bytes=a-b)")
        return response

    def explain(self, exc: BaseException, where: str, doing: str, obj: ObjectVersion | None = None) -> CheckpointError:
        """`exc` of the client as one CheckpointError naming `where`, the cause and the fix."""
        kind = ObjectChanged if status_of(exc) == 412 else CheckpointError
        return kind(redact(_explained(exc, where, doing, self.endpoint, self.url, obj), self.secrets))


def _explained(exc, where: str, doing: str, endpoint: str, url: ObjectUrl, obj) -> str:
    import botocore.exceptions as bx

    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code, status = error.get("Code", "?"), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        tries = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) + 1
        return _client_error(code, status, tries, error.get("Message", ""), where, doing, endpoint, url, obj)
    if isinstance(exc, bx.NoCredentialsError):
        return f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
        return (f"{where}: cannot connect to the S3 endpoint {endpoint} ({exc}); check AWS_ENDPOINT_URL (or the "
                f"region) and that the store is reachable")
    return f"{where}: the S3 request failed ({type(exc).__name__}: {exc}); check the store at {endpoint}"


def _client_error(code, status, tries, message, where, doing, endpoint, url, obj) -> str:
    if code == "NoSuchBucket":
        return (f"{where}: the bucket {url.bucket!r} does not exist at {endpoint}; check the bucket in the URL "
                f"(and AWS_ENDPOINT_URL, AWS_REGION)")
    if code in ("NoSuchKey", "NotFound") or status == 404:
        return (f"{where}: no such object at {endpoint}; check the URL's prefix (the folder that holds config.json "
                f"and the weights), or finish the upload")
    if code == "InvalidAccessKeyId":
        return f"{where}: the store does not know the access key id in use; check AWS_ACCESS_KEY_ID / AWS_PROFILE"
    if code == "SignatureDoesNotMatch":
        return (f"{where}: the secret access key does not match the access key id; check AWS_SECRET_ACCESS_KEY / "
                f"AWS_PROFILE")
    if code in ("ExpiredToken", "TokenRefreshRequired", "RequestExpired"):
        return f"{where}: the credentials have expired ({code}); refresh them (aws sso login, a new session token)"
    if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
        need = "s3:ListBucket on the bucket" if doing == "list" else "s3:GetObject on its objects"
        return (f"{where}: access denied ({code}) to the credentials in use; grant them {need}, or use credentials "
                f"that have it (AWS_PROFILE, AWS_ACCESS_KEY_ID)")
    if code == "PreconditionFailed" or status == 412:
        planned = f" (ETag {obj.etag} when it was planned)" if obj is not None else ""
        return f"{where}: changed on the server during the load{planned}; load again once the upload is complete"
    if status is not None and status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout"):
        return (f"{where}: the store still answered {status} {code} after {tries} attempts (exponential backoff); "
                f"it is overloaded or failing: load again later, or cap the job with --max-gbps")
    return f"{where}: {code} ({status}) from {endpoint}: {message}"


def status_of(exc: BaseException) -> int | None:
    """The HTTP status the store answered with (None: no answer, or not the client's error)."""
    import botocore.exceptions as bx

    if not isinstance(exc, bx.ClientError):
        return None
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_cut_body(exc: BaseException) -> bool:
    """A body that broke off after its headers (reset, closed early, timed out): worth asking for the rest."""
    import botocore.exceptions as bx
    import urllib3.exceptions as ux

    return isinstance(exc, (bx.ResponseStreamingError, bx.IncompleteReadError, bx.ReadTimeoutError,
                            ux.ProtocolError, ux.ReadTimeoutError, ConnectionError, BodyShort))


class BodyShort(Exception):
    """A body that ended cleanly before the bytes its range promised."""


class BodyCursor:
    """Reads response bodies into `views` (in order); `done` counts the bytes in place so far, all whole: after a
    cut, the request for the rest starts there."""

    def __init__(self, views: list[memoryview]):
        self.views, self.done = views, 0
        self.total = sum(len(v) for v in views)

    def read(self, body) -> None:
        try:
            base = 0
            for view in self.views:
                end = base + len(view)
                while self.done < end:
                    local = self.done - base
                    got = body.readinto(view[local:local + BODY_CHUNK])
                    if got == 0:
                        raise BodyShort(f"the body ended after {self.done} of {self.total} bytes")
                    self.done += got
                base = end
        finally:
            body.close()


def redact(text: str, secrets) -> str:
    """`text` with every credential in `secrets` replaced by ***."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text
