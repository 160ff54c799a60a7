"""Element encodings of a golden folder (docs/contract.md §15).

bf16 and fp16 tensors are stored as uint16 bit patterns (NumPy has no bf16).
Decoding is exact; encoding rounds float32 to nearest, ties to even, once,
which is the rounding every stage of the contract uses.
"""
import numpy as np

HALF = ("bfloat16", "float16")


class HalfBits:
    """Bit patterns of a half type that NumPy cannot name (a torch bf16 or
    fp16 tensor's): the encoder takes them as they are for a tensor of that
    type, and converts them, only where no value changes, for the other."""

    def __init__(self, bits, dtype):
        self.bits, self.dtype = np.asarray(bits), dtype


def bf16_to_f32(bits):
    """uint16 bf16 bit patterns to the float32 values they stand for (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError("bf16_to_f32: uint16 bit patterns expected, got %s" % bits.dtype)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values):
    """float32 values to bf16 bit patterns: round to nearest even; a NaN stays a
    (quiet) NaN, infinities stay infinite."""
    v = np.ascontiguousarray(values)
    if v.dtype != np.float32:
        raise TypeError("f32_to_bf16: float32 values expected, got %s (round float64 to float32 "
                        "yourself only if a double rounding is what your code does)" % v.dtype)
    u = v.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(v)
    bits[nan] = ((u[nan] >> 16).astype(np.uint16) | np.uint16(0x0040))
    return bits


def e4m3_to_f32(bits):
    """uint8 e4m3fn bit patterns (FP8 dispatch, docs/contract.md §16) to float32:
    bias 7, subnormals below 2^-6, 0x7f/0xff NaN, no infinity; exact."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint8:
        raise TypeError("e4m3_to_f32: uint8 bit patterns expected, got %s" % bits.dtype)
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    table = np.where(b & 0x80, -mag, mag)
    table[(b & 0x7F) == 0x7F] = np.nan
    return table.astype(np.float32)[bits]


def decode(stored, dtype):
    """A stored array of manifest dtype `dtype` as NumPy values: bf16, fp16
    and e4m3 as float32, everything else as stored."""
    if dtype == "float8_e4m3fn":
        return e4m3_to_f32(stored)
    if dtype == "bfloat16":
        return bf16_to_f32(stored)
    if dtype == "float16":
        return np.asarray(stored).view(np.float16).astype(np.float32)
    return stored


def encode(values, dtype, what):
    """NumPy values to the stored form of manifest dtype `dtype`.

    Floating tensors: float32 values (bf16/fp16 rounded once, to nearest
    even), or uint16 arrays taken as bit patterns already; fp16 also takes
    float16. Values of the other half type (NumPy float16 or HalfBits for a
    bf16 tensor; a torch bf16 tensor for an fp16 one) are converted where
    every value is held exactly, refused where one would change: the
    encoder never rounds a rounded value again. Integer tensors: any integer array whose values fit; it is
    written in the manifest's width. `what` names the tensor in errors."""
    if isinstance(values, HalfBits):
        if values.dtype == dtype:
            return values.bits
        given = "a %s tensor" % values.dtype
        values = decode(values.bits, values.dtype)
        if dtype in HALF:
            return _exactly(values, dtype, what, given)
    a = np.asarray(values)
    if dtype == "bfloat16" and a.dtype == np.float16:
        return _exactly(a.astype(np.float32), dtype, what, "a float16 array")
    if dtype == "float8_e4m3fn":  # the quantisation is the stage under test: bits only
        if a.dtype != np.uint8:
            raise TypeError("%s is float8_e4m3fn: pass the uint8 bit patterns your quantiser wrote, not %s"
                            % (what, dtype_text(a)))
        return a
    if dtype in HALF:
        if a.dtype == np.uint16:
            return a
        if dtype == "float16" and a.dtype == np.float16:
            return a.view(np.uint16)
        if a.dtype != np.float32:
            raise TypeError("%s is %s: pass float32 values (rounded here to %s, once) or uint16 "
                            "bit patterns" % (what, dtype_text(a), dtype))
        if dtype == "bfloat16":
            return f32_to_bf16(a)
        with np.errstate(over="ignore"):  # past fp16's range is infinity, as the contract rounds
            return a.astype(np.float16).view(np.uint16)
    if dtype == "float32":
        if a.dtype == np.float32:
            return a
        if a.dtype.kind == "f":
            return a.astype(np.float32)
        raise TypeError("%s is float32, not %s" % (what, dtype_text(a)))
    if dtype in ("int32", "int64"):
        if a.dtype.kind not in "iu":
            raise TypeError("%s holds integers (%s), not %s" % (what, dtype, dtype_text(a)))
        want = np.dtype(dtype)
        # as Python integers: NumPy compares uint64 with int64 in float64,
        # where 2**63 equals int64's largest value
        if a.size and (int(a.min()) < int(np.iinfo(want).min) or int(a.max()) > int(np.iinfo(want).max)):
            raise ValueError("%s: values outside %s" % (what, dtype))
        return a.astype(want)
    raise ValueError("%s: unknown manifest dtype %r" % (what, dtype))


def _exactly(f32, dtype, what, given_text):
    """float32 values `f32` of the other half type, encoded to `dtype` when
    each is held exactly (NaN stays NaN); else a TypeError naming how many
    would change."""
    bits = encode(f32, dtype, what)
    back = decode(bits, dtype)
    changed = ~((back == f32) | (np.isnan(back) & np.isnan(f32)))
    if changed.any():
        i = int(np.flatnonzero(changed.reshape(-1))[0])
        raise TypeError("%s is %s, given %s: %d of %d values are not %s values (first: element %d, %r becomes %r); "
                        "valid: %s values, or float32 values (rounded here to %s, once)"
                        % (what, dtype, given_text, int(changed.sum()), changed.size, dtype, i,
                           float(f32.reshape(-1)[i]), float(back.reshape(-1)[i]), dtype, dtype))
    return bits


def dtype_text(a):
    return str(a.dtype)
