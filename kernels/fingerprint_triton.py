"""Triton twin of `fingerprint.word_hash_sums_reference`: same per-word terms, block sums, then a torch sum.

Integer addition is associative even with wrap-around, so the per-block partial sums followed by a
torch sum equal the reference's sum bit for bit, whatever the block size or reduction order.
"""

import torch
import triton
import triton.language as tl

from .fingerprint_format import FMIX_1, FMIX_2, GOLDEN, SPLITMIX_1, SPLITMIX_2

# Triton kernels may only read module globals that are constexpr.
_GOLDEN = tl.constexpr(GOLDEN)
_SPLITMIX_1 = tl.constexpr(SPLITMIX_1)
_SPLITMIX_2 = tl.constexpr(SPLITMIX_2)
_FMIX_1 = tl.constexpr(FMIX_1)
_FMIX_2 = tl.constexpr(FMIX_2)

_BLOCK_WORDS = 4096


@triton.jit
def _shr(x, BITS: tl.constexpr):
    # logical shift right of int64: arithmetic shift, then drop the copied sign bits
    return (x >> BITS) & ((1 << (64 - BITS)) - 1)


@triton.jit
def _splitmix64(s):
    z = (s ^ _shr(s, 30)) * _SPLITMIX_1
    z = (z ^ _shr(z, 27)) * _SPLITMIX_2
    return z ^ _shr(z, 31)


@triton.jit
def _fmix64(s):
    z = (s ^ _shr(s, 33)) * _FMIX_1
    z = (z ^ _shr(z, 33)) * _FMIX_2
    return z ^ _shr(z, 33)


@triton.jit
def _word_hash_partials_kernel(words_ptr, partials_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    index = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: tensors beyond 2**31 words
    in_range = index < n_words
    word = tl.load(words_ptr + index, mask=in_range, other=0)
    state = word.to(tl.uint32, bitcast=True).to(tl.int64) + (index + 1) * _GOLDEN
    h1 = tl.where(in_range, _splitmix64(state), 0)
    h2 = tl.where(in_range, _fmix64(state), 0)
    tl.store(partials_ptr + 2 * pid, tl.sum(h1, axis=0))
    tl.store(partials_ptr + 2 * pid + 1, tl.sum(h2, axis=0))


def word_hash_sums_triton(words: torch.Tensor) -> torch.Tensor:
    """int64[2] on words.device: (sum h1, sum h2) over the contiguous int32 `words`, positions from 0."""
    n_words = words.numel()
    if n_words == 0:
        return torch.zeros(2, dtype=torch.int64, device=words.device)
    n_blocks = triton.cdiv(n_words, _BLOCK_WORDS)
    partials = torch.empty(n_blocks, 2, dtype=torch.int64, device=words.device)
    _word_hash_partials_kernel[(n_blocks,)](words, partials, n_words, BLOCK=_BLOCK_WORDS, num_warps=8)
    return partials.sum(dim=0)
