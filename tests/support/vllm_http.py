"""vLLM's OpenAI server as a user runs it, for the vLLM stage: the README's command (readme_blocks.py), a tiny
word-level tokenizer so that prompts and completions are text, and completion requests over HTTP on 127.0.0.1
(urllib: what curl would send).

    server = Server(command, ckpt, workdir).start()
    server.wait_ready()             # /health answers (or the server died: AssertionError with its last lines)
    server.complete("w17 w42 w99")  # {"text": ..., "tokens": [...], "logprobs": [...]}
    server.greedy_ids([1, 17, 42])  # the completion's token ids; server.post(path, body), server.get(path): JSON
    server.stop()
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

VOCAB = 250          # hf_models.COMMON's vocab_size
STEPS = 16
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# What the tests add to the README's command: a free port, and no torch.compile (minutes on a 2-core VM).
SMALL_MACHINE = "--enforce-eager --max-model-len 128"


def add_tokenizer(ckpt: Path) -> Path:
    """A tokenizer for the tiny checkpoints: word i is "w{i}" (0-2: pad, bos, eos), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(ckpt)
    return ckpt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process tree (its own session, so stop() ends the engine and its workers too); every line it
    writes (stdout and stderr together) is kept with the time it came."""

    def __init__(self, command: str, ckpt: Path, workdir: Path):
        self.command, self.ckpt, self.workdir = command, ckpt, workdir
        self.port = free_port()
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        full = f"{self.command} --port {self.port} {SMALL_MACHINE}"
        # in this interpreter's venv, activated (its bin/ first on PATH), as a user who installed it runs the command
        venv_bin = str(Path(sys.executable).parent)
        env = {**os.environ, **VLLM_ENV, "CKPT": str(self.ckpt), "VIRTUAL_ENV": sys.prefix,
               "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.proc = subprocess.Popen(["bash", "-c", full], cwd=self.workdir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.reader.join(10)
                raise AssertionError(f"the server exited {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise AssertionError(f"the server was not ready after {timeout} s:\n{self.tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict | None = None) -> dict:
        """POST `body` as JSON to `path` (e.g. "/v1/completions"); the reply's JSON."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.loads(reply.read())

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=300) as reply:
            return json.loads(reply.read())

    def complete(self, prompt: str) -> dict:
        """One greedy completion of STEPS tokens: its text, token ids and their logprobs."""
        choice = self.post("/v1/completions", {"model": str(self.ckpt), "prompt": prompt, "max_tokens": STEPS,
                                               "temperature": 0.0, "ignore_eos": True, "logprobs": 1})["choices"][0]
        return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
                "logprobs": choice["logprobs"]["token_logprobs"]}

    def greedy_ids(self, prompt_ids: list[int]) -> list[int]:
        """The token ids of one greedy completion of STEPS tokens of a prompt given as token ids."""
        body = {"model": str(self.ckpt), "prompt": prompt_ids, "max_tokens": STEPS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        return self.post("/v1/completions", body)["choices"][0]["token_ids"]

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status within `timeout` seconds (None: still running)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.reader.join(10)
        return rc

    def first_line_with(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    def stop(self) -> None:
        """End the server and whatever of its tree is left (an engine core or worker may outlive a failed server)."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
