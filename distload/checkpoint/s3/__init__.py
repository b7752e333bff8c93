"""Checkpoints in object storage (`s3://bucket/prefix`, any S3-compatible endpoint: DESIGN §4.2d).

url.py      the URL, keys and object versions (pure)
client.py   the S3 client (boto3: the credential chain, signing, retries), its errors in distload's words
listing.py  rank 0's discovery: list the prefix, fetch config, index and headers by ranged GETs
fetch.py    ranged GETs into the caller's buffers: pieces in flight at once, paced, through the node cache
cache.py    the node cache (--cache-dir): fetched ranges on local disk, keyed by ETag
pace.py     the bandwidth cap (--max-gbps), pure
reader.py   the Reader of a load's transfer over fetch.py

The client library is imported only when an s3:// path is used (the `s3` extra).
"""

from .url import ObjectUrl, ObjectVersion, is_object_url

__all__ = ["ObjectUrl", "ObjectVersion", "is_object_url"]
