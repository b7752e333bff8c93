"""A real S3 server for the tests: moto's ThreadedMotoServer on 127.0.0.1, its WSGI app wrapped by a request log
and fault injection (no mocked client: every client speaks HTTP to it).

    with S3Server() as s3:
        s3.upload(checkpoint_dir, "bkt", "llama")          # s3://bkt/llama/...
        s3.faults.add("503", key=r"\\.safetensors$", skip=2, times=3)
        ... jobs with env=s3.env() ...
        s3.log.ranged_bytes(r"\\.safetensors$")             # body bytes of the GETs that answered 206

Faults: "503" (SlowDown) and "500" (InternalError) answer instead of moto; "reset" sends `after_bytes` of the body
then an RST; "short" sends `after_bytes` then closes cleanly (a body shorter than its Content-Length); "call"
runs fn(entry) before moto answers (e.g. overwrite the object mid-load).

As a process (benchmarks: the server's GIL away from the clients):
    python tests/support/s3_server.py [--fast-ranges]   prints its URL, serves until stdin closes;
    GET URL/_log (the request log as JSON), POST URL/_log/clear.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote

os.environ.setdefault("MOTO_ALLOW_NONEXISTENT_REGION", "true")  # moto reads its settings at import

from moto.moto_server.threaded_moto_server import ThreadedMotoServer  # noqa: E402
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

logging.getLogger("werkzeug").setLevel(logging.ERROR)

REGION = "us-east-1"
ADMIN_KEY, ADMIN_SECRET = "admin-key-id", "admin-secret-key"
_S3_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
             '<RequestId>fault</RequestId></Error>')
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


@dataclasses.dataclass
class Entry:
    """One request as the server saw it and answered it."""
    t: float
    method: str
    bucket: str
    key: str
    query: str
    range: str | None
    if_match: str | None
    status: int = 0
    sent: int = 0             # body bytes written to the socket
    fault: str | None = None

    @property
    def span(self) -> tuple[int, int] | None:
        """[start, end) the Range header asked for (None: no single range)."""
        m = _RANGE.fullmatch(self.range or "")
        return (int(m.group(1)), int(m.group(2)) + 1) if m else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class RequestLog:
    def __init__(self, entries: list[Entry] | None = None):
        self.entries: list[Entry] = list(entries or [])
        self._lock = threading.Lock()

    def add(self, e: Entry) -> None:
        with self._lock:
            self.entries.append(e)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()

    def gets(self, key: str | None = None) -> list[Entry]:
        """Object GETs (not listings), those whose key matches the regex `key` when given."""
        return [e for e in self.entries if e.method == "GET" and e.key and (key is None or re.search(key, e.key))]

    def ranged(self, key: str | None = None) -> list[Entry]:
        """GETs that answered 206 with their whole body and no injected fault."""
        return [e for e in self.gets(key) if e.status == 206 and e.fault is None]

    def ranged_bytes(self, key: str | None = None) -> int:
        return sum(e.sent for e in self.ranged(key))

    def count(self, method: str) -> int:
        return sum(1 for e in self.entries if e.method == method)

    def about(self, prefix: str) -> list[Entry]:
        """The requests about the checkpoint under `prefix`: its objects, and listings of it."""
        return [e for e in self.entries if e.key.startswith(f"{prefix}/") or
                (not e.key and e.bucket and f"prefix={prefix}/" in e.query)]


@dataclasses.dataclass
class Rule:
    action: str                  # "503" | "500" | "reset" | "short" | "call"
    key: str | None = None       # regex on the key (None: any object)
    method: str = "GET"
    range: str | None = None     # regex on the Range header
    skip: int = 0                # let this many matching requests through first
    times: int = 1               # then fault this many
    after_bytes: int = 4096      # reset / short: body bytes sent before the cut
    fn: object = None            # call: fn(entry), before moto answers
    fired: int = 0

    def matches(self, e: Entry) -> bool:
        return (bool(e.key) and e.method == self.method and (self.key is None or re.search(self.key, e.key) is not None)
                and (self.range is None or re.search(self.range, e.range or "") is not None))


class Faults:
    def __init__(self):
        self.rules: list[Rule] = []
        self._lock = threading.Lock()

    def add(self, action: str, **kw) -> Rule:
        rule = Rule(action, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def pick(self, e: Entry) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.fired < rule.skip + rule.times and rule.matches(e):
                    rule.fired += 1
                    if rule.fired > rule.skip:
                        return rule
        return None

    def fired(self) -> int:
        """Faults injected so far (requests answered by a rule, not by moto)."""
        return sum(max(0, r.fired - r.skip) for r in self.rules)


class Logged:
    """The WSGI wrapper: logs every request and injects the faults."""

    def __init__(self, app, log: RequestLog, faults: Faults):
        self.app, self.log, self.faults = app, log, faults

    def __call__(self, environ, start_response):
        path = unquote(environ.get("PATH_INFO", "")).lstrip("/")
        if path.startswith("_log"):
            return self._control(environ, start_response, path)
        bucket, _, key = path.partition("/")
        e = Entry(time.time(), environ["REQUEST_METHOD"], bucket, key, unquote(environ.get("QUERY_STRING", "")),
                  environ.get("HTTP_RANGE"), environ.get("HTTP_IF_MATCH"))
        if bucket == "moto-api":
            return self.app(environ, start_response)
        self.log.add(e)
        rule = self.faults.pick(e)
        e.fault = rule.action if rule is not None else None
        if rule is not None and rule.action in ("503", "500"):
            code, message = (("SlowDown", "Please reduce your request rate.") if rule.action == "503" else
                             ("InternalError", "We encountered an internal error. Please try again."))
            body = _S3_ERROR.format(code=code, message=message).encode()
            e.status, e.sent = int(rule.action), len(body)
            start_response(f"{rule.action} {code}", [("Content-Type", "application/xml"),
                                                     ("Content-Length", str(len(body)))])
            return [body]
        if rule is not None and rule.action == "call":
            rule.fn(e)

        def respond(status, headers, exc_info=None):
            e.status = int(status.split()[0])
            return start_response(status, headers, exc_info)

        body = self.app(environ, respond)
        if rule is not None and rule.action in ("reset", "short"):
            return _cut(body, e, rule, environ["werkzeug.socket"])
        return _counted(body, e)

    def _control(self, environ, start_response, path):
        if path == "_log/clear":
            self.log.clear()
            self.faults.clear()
        payload = json.dumps([e.as_dict() for e in self.log.entries] if path == "_log" else {"ok": True}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        return [payload]


def _counted(body, e: Entry):
    try:
        for chunk in body:
            e.sent += len(chunk)
            yield chunk
    finally:
        if hasattr(body, "close"):
            body.close()


def _cut(body, e: Entry, rule: Rule, sock):
    data = b"".join(body)
    n = min(rule.after_bytes, max(len(data) - 1, 0))
    e.sent = n
    yield data[:n]   # werkzeug writes it with the full Content-Length header
    if rule.action == "reset":   # an RST: linger on, timeout 0, then close
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    else:                        # a clean FIN after n bytes of a longer body
        sock.shutdown(socket.SHUT_RDWR)


class S3Server(ThreadedMotoServer):
    """ThreadedMotoServer on 127.0.0.1 (a free port), its app wrapped by Logged."""

    def __init__(self, fast_ranges: bool = False):
        super().__init__("127.0.0.1", 0, verbose=False)
        if fast_ranges:
            patch_fast_ranges()
        self.log, self.faults = RequestLog(), Faults()

    def _server_entry(self) -> None:   # ThreadedMotoServer's, with the wrapper around moto's app
        app = Logged(DomainDispatcherApplication(create_backend_app), self.log, self.faults)
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server.daemon_threads = True
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def url(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._server is not None:
            self._server.server_close()

    def env(self, key: str = ADMIN_KEY, secret: str = ADMIN_SECRET) -> dict[str, str]:
        """What a job needs to reach this server through the usual AWS variables (and no instance metadata)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def client(self, service: str = "s3", key: str = ADMIN_KEY, secret: str = ADMIN_SECRET):
        import boto3

        return boto3.client(service, endpoint_url=self.url, region_name=REGION, aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def upload(self, directory, bucket: str, prefix: str) -> str:
        """Every file directly in `directory` to s3://bucket/prefix/; returns that URL."""
        s3 = self.client()
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        for path in sorted(Path(directory).iterdir()):
            if path.is_file():
                s3.upload_file(str(path), bucket, f"{prefix}/{path.name}")
        return f"s3://{bucket}/{prefix}"

    def user(self, name: str, actions: list[str]) -> tuple[str, str]:
        """An IAM user allowed `actions` on every resource: (access key id, secret)."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        arn = iam.create_policy(PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
        iam.attach_user_policy(UserName=name, PolicyArn=arn)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def enforce_auth(self, on: bool = True) -> None:
        """From now on every request is authenticated and authorized against moto's IAM (make users first); off:
        none is (moto's default; its state is the process's, so a test that turns it on turns it off after)."""
        import urllib.request

        count = b"0" if on else b"inf"
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=count, method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request).read()


def fetched_log(url: str) -> RequestLog:
    """The request log of a server running as a process (its /_log)."""
    import urllib.request

    entries = json.loads(urllib.request.urlopen(f"{url}/_log").read())
    return RequestLog([Entry(**e) for e in entries])


def clear_log(url: str) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/_log/clear", data=b"", method="POST")).read()


_lazy = threading.local()


def patch_fast_ranges() -> None:
    """moto answers a ranged GET by reading the whole object; this makes it read only the range (benchmarks of
    checkpoints larger than a few MB: the same server for every loader). Idempotent."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    if getattr(S3Response, "distload_fast_ranges", False):
        return
    value, get_object, key_response = FakeKey.value, S3Response.get_object, S3Response.key_response

    class RangeOnly:
        def __init__(self, key):
            self.key = key

        def __len__(self):
            return self.key.contentsize

        def __bool__(self):
            return self.key.contentsize > 0

        def __getitem__(self, s):
            start, stop, _ = s.indices(len(self))
            with self.key.lock:
                self.key._value_buffer.seek(start)
                return self.key._value_buffer.read(max(stop - start, 0))

    def lazy_value(self):
        return RangeOnly(self) if getattr(_lazy, "on", False) else value.fget(self)

    def ranged_get_object(self):
        _lazy.on = bool(re.fullmatch(r"bytes=\d*-\d*", (self.headers.get("range") or "").strip()))
        try:
            return get_object(self)
        finally:
            _lazy.on = False

    def whole_if_ignored(self, request, full_url, headers):
        status, hdrs, body = key_response(self, request, full_url, headers)
        return status, hdrs, (body[0:len(body)] if isinstance(body, RangeOnly) else body)

    FakeKey.value = property(lazy_value, value.fset)
    S3Response.get_object, S3Response.key_response = ranged_get_object, whole_if_ignored
    S3Response.distload_fast_ranges = True


if __name__ == "__main__":
    with S3Server(fast_ranges="--fast-ranges" in sys.argv) as server:
        print(server.url, flush=True)
        sys.stdin.read()
