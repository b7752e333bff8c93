"""What a vLLM worker's model held, for tests/test_vllm.py: vLLM's worker_extension_cls and a load hook.

One hook wraps vLLM's process_weights_after_loading (looked up in base_loader at call time, so it
applies to every loader) and keeps, on the model itself, a digest of every param as loaded: on CPU the
linear weights move into oneDNN handles there, so this first snapshot is the one that shows every loaded
byte. Another times each loader's whole load_model and the storage bytes it made the worker read.
The results live on the model, not in a module global: the driver's `__main__` and the worker's
import of this module may be two module objects.
"""

from __future__ import annotations

import hashlib
import time

import torch

LOADED_ATTR = "distload_probe_loaded"
LOAD_ATTR = "distload_probe_load"  # seconds and storage bytes of the worker's whole model load


def storage_read_bytes() -> int:
    """Bytes this process made storage read (/proc/self/io read_bytes: page-cache misses, mmap included)."""
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("read_bytes:")).split()[1])


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    return f"{t.dtype} {list(t.shape)} {hashlib.sha256(raw.numpy().tobytes()).hexdigest()}"


def state_digests(tensors) -> dict[str, str]:
    return {name: tensor_digest(t) for name, t in tensors}


def install_load_hook() -> None:
    """Digest the loaded params right before vLLM's post-load processing (idempotent)."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "distload_probe", False):
        return

    def digested_then_processed(model, model_config, target_device):
        start = time.perf_counter()
        setattr(model, LOADED_ATTR, state_digests(model.named_parameters(remove_duplicate=False)))
        model.distload_probe_digest_s = time.perf_counter() - start  # not part of the load's time
        return original(model, model_config, target_device)

    digested_then_processed.distload_probe = True
    base_loader.process_weights_after_loading = digested_then_processed
    load_model = base_loader.BaseModelLoader.load_model

    def measured_load(self, *args, **kwargs):
        start, read_before = time.perf_counter(), storage_read_bytes()
        model = load_model(self, *args, **kwargs)
        seconds = time.perf_counter() - start - getattr(model, "distload_probe_digest_s", 0.0)
        setattr(model, LOAD_ATTR, {"seconds": seconds,
                                   "storage_read_bytes": storage_read_bytes() - read_before})
        return model

    base_loader.BaseModelLoader.load_model = measured_load


install_load_hook()  # imported by each worker (as its worker_extension_cls module) before it loads


class StateProbe:
    """Mixed into vLLM's worker class: what the worker's model held after loading and after processing."""

    def distload_probe_state(self) -> dict:
        model = self.model_runner.model
        state = {"loaded": getattr(model, LOADED_ATTR, {}), "load": getattr(model, LOAD_ATTR, {}),
                 "processed": state_digests(model.state_dict().items()),
                 "state_dict_names": sorted(model.state_dict())}
        draft = getattr(getattr(self.model_runner, "drafter", None), "model", None)  # a speculative draft model
        if draft is not None:
            state["draft"] = {"loaded": getattr(draft, LOADED_ATTR, {}),
                              "processed": state_digests(draft.state_dict().items())}
        return state
