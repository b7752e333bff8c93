"""The fingerprint's hash, defined once for the torch reference (fingerprint.py) and the Triton kernel.

The tensor's bytes, in logical (row-major) order, are read as little-endian int32 words, the
last one zero-padded. Word i with bits w becomes the 64-bit state s_i = zext(w) + (i + 1) * GOLDEN,
and two bijective 64-bit finalizers (splitmix64's and murmur3's fmix64) turn s_i into h1_i, h2_i.
The fingerprint is (sum h1_i + L1, sum h2_i + L2) mod 2**64, stored as two signed int64 values, where
L1, L2 hash the byte count.
"""


def _signed64(value: int) -> int:
    """The 64-bit pattern of `value` as a signed int64, the only 64-bit integer torch and Triton hold."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = _signed64(0x9E3779B97F4A7C15)
SPLITMIX_1 = _signed64(0xBF58476D1CE4E5B9)
SPLITMIX_2 = _signed64(0x94D049BB133111EB)
FMIX_1 = _signed64(0xFF51AFD7ED558CCD)
FMIX_2 = _signed64(0xC4CEB9FE1A85EC53)
LENGTH_SALT = _signed64(0x6A09E667F3BCC909)  # keeps the length term apart from the word terms
