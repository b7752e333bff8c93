"""s3:// URLs, object keys and the version of an object a load pins (pure: no client, no network)."""

from __future__ import annotations

from dataclasses import dataclass

from distload.errors import CheckpointError

SCHEME = "s3://"


def is_object_url(path) -> bool:
    """Is `path` an object-storage URL (s3://bucket/prefix) rather than a local path?"""
    return str(path).startswith(SCHEME)


@dataclass(frozen=True)
class ObjectUrl:
    """s3://bucket/prefix: a checkpoint's objects are the keys `prefix/NAME` (prefix may be empty)."""
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, text: str) -> ObjectUrl:
        if not is_object_url(text):
            raise CheckpointError(f"{text}: not an s3:// URL; write s3://BUCKET/PREFIX")
        bucket, _, prefix = text[len(SCHEME):].partition("/")
        prefix = prefix.strip("/")
        if not bucket or any(part in ("", ".", "..") for part in prefix.split("/") if prefix):
            raise CheckpointError(f"{text}: expected s3://BUCKET/PREFIX (a bucket name, then the key prefix that "
                                  f"holds config.json and the weights), without empty, '.' or '..' parts")
        return cls(bucket, prefix)

    def key(self, name: str) -> str:
        """The key of the checkpoint's file `name` (relative to the prefix)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def name_of(self, key: str) -> str:
        """The file name relative to the prefix of one of its keys."""
        return key[len(self.prefix) + 1:] if self.prefix else key

    def of(self, name: str) -> str:
        """The URL of the checkpoint's file `name`."""
        return f"{SCHEME}{self.bucket}/{self.key(name)}"

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


@dataclass(frozen=True)
class ObjectVersion:
    """One object as planned: every range a load fetches of it must come from this ETag (If-Match)."""
    key: str
    size: int
    etag: str
