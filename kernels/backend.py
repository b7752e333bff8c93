"""Which implementation runs a kernel: Triton on CUDA, the plain-torch reference everywhere else.

Triton is imported lazily, only by the `*_triton` modules and only when a Triton path is taken, so
`import distload.kernels` stays cheap and works on machines without triton (CPU CI, gloo tests).
`HAVE_TRITON` only says whether the package is installed; a triton that is installed but broken is
not hidden: the real ImportError surfaces on the first Triton call.

`DISTLOAD_FORCE_TRITON=1` runs the Triton kernels on CPU tensors too; that only works together with
`TRITON_INTERPRET=1` (the tests use the pair to check kernels without a GPU).
"""

import importlib.util
import logging
import os

import torch

HAVE_TRITON: bool = importlib.util.find_spec("triton") is not None
FORCE_TRITON_ENV = "DISTLOAD_FORCE_TRITON"

_TRUE_WORDS = ("1", "true", "yes", "on")
_log = logging.getLogger(__name__)
_warned_no_triton = False


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE_WORDS


def triton_interpreting() -> bool:
    """True when triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1)."""
    return _env_flag("TRITON_INTERPRET")


def use_triton(t: torch.Tensor, needs_fp8: bool = False) -> bool:
    """Whether the kernel for tensor `t` should run in Triton.

    needs_fp8: the kernel loads or stores float8_e4m3fn, which Triton compiles only for
    compute capability >= 8.9 (Ada, Hopper); older GPUs use the torch reference, which torch runs
    on the GPU anyway.
    """
    global _warned_no_triton
    if _env_flag(FORCE_TRITON_ENV):
        if not HAVE_TRITON:
            raise RuntimeError(
                f"{FORCE_TRITON_ENV}=1 but triton is not installed; install triton or unset {FORCE_TRITON_ENV}"
            )
        return True
    if not t.is_cuda:
        return False
    if not HAVE_TRITON:
        # A CUDA torch without triton is a legitimate setup: the references run on the GPU too,
        # just slower. Say so once instead of per tensor.
        if not _warned_no_triton:
            _log.warning("triton is not installed: distload.kernels uses the torch references on CUDA")
            _warned_no_triton = True
        return False
    if needs_fp8 and torch.cuda.get_device_capability(t.device) < (8, 9):
        return False
    return True


def cast_in_kernel(device: torch.device) -> bool:
    """Whether a Triton kernel may do its own fp32 -> fp8/bf16 store conversion.

    Compiled CUDA kernels convert with round-to-nearest-even like torch. Triton's interpreter does not
    (its fp8 cast drops the rounding carry and does not saturate, its bf16 cast truncates), so there the
    kernels store fp32 and torch performs the final cast: results stay bit-equal to the references.
    """
    return device.type == "cuda" and not triton_interpreting()
