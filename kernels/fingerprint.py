"""A cheap, order-sensitive 128-bit fingerprint of a tensor's raw bytes.

Reconcile (DESIGN §2 step 7) all-gathers the fingerprints of replicated params to prove every rank
holds bit-identical copies without moving the params themselves.

The hash is defined in fingerprint_format (shared with the Triton kernel).

Why this shape:
- sums are associative, so a GPU block reduction gives exactly the value of the CPU reference;
- for a fixed position i, w -> h_i is a bijection, so a change confined to one word (e.g. any one
  element of a dtype of at most 4 bytes) always changes the sums: certain, not just probable;
  wider changes collide only by a ~2**-64 accident per component;
- the position enters every term, so swapping two different words changes the sums (up to a
  2**-64-ish accident per component);
- the byte count is folded in, so the zero padding of the tail cannot collide with real zero bytes.
All arithmetic is int64 with wrap-around (torch and Triton both wrap on overflow); logical right
shifts are spelled as arithmetic shifts plus a mask, because int64 has no unsigned shift.
"""

import torch

from .backend import use_triton
from .fingerprint_format import FMIX_1, FMIX_2, GOLDEN, LENGTH_SALT, SPLITMIX_1, SPLITMIX_2

REFERENCE_CHUNK_WORDS = 1 << 21  # the reference's int64 temporaries stay at a few 16 MiB each


@torch.no_grad()
def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64[2] on CPU: hash of t's bytes in logical order; Triton on CUDA, else the reference."""
    body, tail = _as_words(t)
    if use_triton(body):
        from .fingerprint_triton import word_hash_sums_triton

        sums = word_hash_sums_triton(body)
    else:
        sums = word_hash_sums_reference(body, first_index=0)
    return _finish(sums, tail, body.numel(), t)


@torch.no_grad()
def fingerprint_reference(t: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of `fingerprint` (runs on t's device)."""
    body, tail = _as_words(t)
    return _finish(word_hash_sums_reference(body, first_index=0), tail, body.numel(), t)


# Tensors up to this size are hashed together in one vectorised pass (fingerprints): reconcile hashes every
# replicated param (norms, biases: a few KiB each, ~20 per rank for a Llama), where the ~30 tensor ops of
# one `fingerprint` call cost more than the bytes.
_BATCH_MAX_BYTES = 1 << 20


@torch.no_grad()
def fingerprints(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[fingerprint(t) for t in tensors], the same values; small CPU tensors whose byte count is a whole
    number of words are hashed together (each word's position restarts at each tensor, as it does alone)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    batch = []
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if t.device.type == "cpu" and 0 < n <= _BATCH_MAX_BYTES and n % 4 == 0:
            batch.append(i)
        else:
            out[i] = fingerprint(t)
    if batch:
        words = [_as_words(tensors[i])[0] for i in batch]
        counts = torch.tensor([w.numel() for w in words], dtype=torch.int64)
        segment = torch.repeat_interleave(torch.arange(len(batch)), counts)
        starts = torch.cumsum(counts, 0) - counts
        state = torch.arange(1, int(counts.sum()) + 1, dtype=torch.int64) - starts[segment]
        state *= GOLDEN
        state += torch.cat(words).to(torch.int64) & 0xFFFFFFFF
        h2 = state.clone()
        sums = torch.zeros(len(batch), 2, dtype=torch.int64)
        sums[:, 0].index_add_(0, segment, _splitmix64_(state))
        sums[:, 1].index_add_(0, segment, _fmix64_(h2))
        length = (counts * 4) ^ LENGTH_SALT
        sums[:, 0] += _splitmix64_(length.clone())
        sums[:, 1] += _fmix64_(length.clone())
        for k, i in enumerate(batch):
            out[i] = sums[k].clone()
    return out


@torch.no_grad()
def word_hash_sums_reference(words: torch.Tensor, first_index: int) -> torch.Tensor:
    """int64[2]: (sum h1, sum h2) over int32 `words`, the first one at word position `first_index`."""
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), REFERENCE_CHUNK_WORDS):
        chunk = words[start : start + REFERENCE_CHUNK_WORDS]
        first = first_index + start + 1
        state = torch.arange(first, first + chunk.numel(), dtype=torch.int64, device=words.device)
        state *= GOLDEN
        state += chunk.to(torch.int64) & 0xFFFFFFFF
        h2 = state.clone()
        sums[0] += _splitmix64_(state).sum()
        sums[1] += _fmix64_(h2).sum()
    return sums


# The mixers work in place: the reference runs in production on CPU ranks, where every int64
# temporary costs 8 bytes per word.


def _xor_shr_(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z ^= z >>> bits (logical shift: torch's >> on int64 is arithmetic, so mask the sign copies)."""
    shifted = z >> bits
    shifted &= (1 << (64 - bits)) - 1
    return z.bitwise_xor_(shifted)


def _splitmix64_(z: torch.Tensor) -> torch.Tensor:
    _xor_shr_(z, 30).mul_(SPLITMIX_1)
    _xor_shr_(z, 27).mul_(SPLITMIX_2)
    return _xor_shr_(z, 31)


def _fmix64_(z: torch.Tensor) -> torch.Tensor:
    _xor_shr_(z, 33).mul_(FMIX_1)
    _xor_shr_(z, 33).mul_(FMIX_2)
    return _xor_shr_(z, 33)


def _as_words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(body, tail): the whole int32 words of t's bytes (a view when aligned) and the 0..3 left-over bytes."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n_body = raw.numel() // 4
    if raw.storage_offset() % 4:
        # a slice starting mid-word cannot be viewed as int32; one aligned copy is the price
        raw = raw.clone()
    return raw[: n_body * 4].view(torch.int32), raw[n_body * 4 :]


def _finish(sums: torch.Tensor, tail: torch.Tensor, n_body: int, t: torch.Tensor) -> torch.Tensor:
    """Adds the zero-padded tail word and the byte-count term; returns int64[2] on CPU."""
    if tail.numel():
        padded = torch.zeros(4, dtype=torch.uint8, device=tail.device)
        padded[: tail.numel()] = tail
        sums = sums + word_hash_sums_reference(padded.view(torch.int32), first_index=n_body)
    n_bytes = t.numel() * t.element_size()
    length = torch.tensor(n_bytes ^ LENGTH_SALT, dtype=torch.int64)
    length_terms = torch.stack([_splitmix64_(length.clone()), _fmix64_(length.clone())])
    return sums.cpu() + length_terms
