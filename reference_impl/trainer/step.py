"""The trainer's deterministic stand-in for an optimizer step between syncs: an elementwise function of
each value.

`step(x, k, seed)` = x * (1 + EPS * h_k(x)), where h_k(x) is a pseudo-random number in +-[0.5, 1)
computed from the bits of x (its fp32 / bf16 / fp16 bit pattern), the step index k and the seed only.
Its sign is + or - with even odds, so steps move values both ways and many of them leave the model's scale
as it was, as an optimizer's do: over 200 steps a tensor's norm moves by a few per cent (tests/test_step.py).
Because it depends on nothing but the value, it commutes with every layout change a converter makes
(TP gathers, splits and concatenations, transposes, vocab-padding trims, expert re-indexing and
stacking): stepping the Megatron shards and exporting gives, bit for bit, what exporting and then
stepping the HF tensors gives. That is what lets the harness compute the expected state after every
sync from the checkpoint alone, sharing no code with the export or the transport.

EPS = 2**-6 makes every element change in every dtype used here: the relative change lies in
[2**-7, 2**-6], at least the largest half-spacing of bfloat16 (2**-8), so a rounded step never
leaves a bf16 value as it was (zeros stay zero). The exception is subnormal values, spaced absolutely:
a float16 one (below 6.1e-5 in magnitude) may keep its value; fp32 and bf16 subnormals (below 1.2e-38)
do not occur in the checkpoints here (tests/test_step.py checks all of this against a second
implementation). The arithmetic is int32 hashing and fp32 math,
rounded to the tensor's dtype, elementwise on CPU: reproducible bit for bit in any process. It walks
the tensor in blocks of 256 Ki elements, each block's temporaries made once and updated in place (bf16:
about 2.3 ms per million elements on two threads here, 4.4 on one, against 3.9 and 6.0 with a new tensor
per op; fp32 about 3.7 and 7.1). The two masks that make the shifts logical cost 3-14 % (two threads, A/B in
one process: bf16 median 4.01 against 3.88 ms per million elements, fp32 4.09 against 3.92).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

EPS_LOG2 = -6
EPS = 2.0**EPS_LOG2
BLOCK = 1 << 18  # elements per block: its temporaries (about 1 MiB each) stay in cache
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_GOLDEN = -1640531535  # 0x9E3779B1 as a signed int32 (Fibonacci hashing)
_MIX = 0x2C1B3C6D  # a murmur-style int32 finaliser constant


def _key(k: int, seed: int) -> int:
    """A 31-bit key of (seed, step)."""
    return (seed * 1_000_003 + k * 7_919 + 0x5851F42D) & 0x7FFFFFFF


def noise_(bits: torch.Tensor, key: int) -> torch.Tensor:
    """h(x) for one block: fp32 values in +-[0.5, 1), from `bits`, the block's bit patterns (int32, or int16
    sign-extended to int32; never changed), keyed by `_key(k, seed)`. The magnitude comes from the int32 hash's
    low 24 bits, the sign from its top bit."""
    # the first op makes the block's one int32 temporary, hashed in place from then on (wrapping arithmetic)
    z = torch.mul(bits, _GOLDEN) if bits.dtype == torch.int32 else bits.to(torch.int32).mul_(_GOLDEN)
    z.add_(key)
    # logical shifts (the masks drop the copies of the sign bit torch's int32 `>>` shifts in): an
    # arithmetic shift XORed into z clears its top bit, and every h would be positive
    z.bitwise_xor_((z >> 15).bitwise_and_(0x1FFFF))
    z.mul_(_MIX)
    z.bitwise_xor_((z >> 12).bitwise_and_(0xFFFFF))
    h = (z & 0xFFFFFF).to(torch.float32).mul_(2.0**-25).add_(0.5)
    return h.copysign_(z.to(torch.float32))  # negative where z < 0 (z == 0 gives +0.0: positive)


def step(x: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """One step: x * (1 + EPS * h_k(x)) in fp32, rounded to x's dtype (a new tensor, same shape).

    Raises:
        TypeError: a dtype other than float32 / bfloat16 / float16.
    """
    if x.dtype not in _BITS_DTYPE:
        raise TypeError(f"the trainer step is defined for float32, bfloat16 and float16 tensors, not {x.dtype}")
    src = x.detach().contiguous().reshape(-1)
    bits = src.view(_BITS_DTYPE[x.dtype])
    out = torch.empty_like(src)
    key, wide = _key(k, seed), x.dtype == torch.float32
    for i in range(0, src.numel(), BLOCK):
        j = i + BLOCK
        factor = noise_(bits[i:j], key).mul_(EPS).add_(1.0)
        if wide:
            torch.mul(src[i:j], factor, out=out[i:j])
        else:
            out[i:j] = factor.mul_(src[i:j])  # the fp32 product, rounded to the dtype as it is stored
    return out.reshape(x.shape)


def step_(x: torch.Tensor, k: int, seed: int) -> None:
    """`step` in place (x must not require grad, e.g. a parameter under `torch.no_grad()`)."""
    x.copy_(step(x, k, seed))


def apply(params: Iterable[tuple[str, torch.Tensor]], k: int, seed: int) -> int:
    """Step k on every (name, parameter) in place, under no_grad (what the trainer runs between syncs;
    a seam: `reference_impl.seams`). Returns how many tensors were stepped."""
    n = 0
    with torch.no_grad():
        for _, p in params:
            step_(p, k, seed)
            n += 1
    return n
