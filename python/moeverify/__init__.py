"""moeverify's Python side: read a golden folder written by `moeverify
export`, run your implementation on its inputs, and write its outputs where
`moeverify check` judges them (docs/contract.md §15).

    import moeverify
    for g in moeverify.open_all("golden"):
        for r in range(g.ranks):
            x = g.input("x", rank=r)                     # float32 (bf16 decoded)
            g.write("dispatch.routed_input", my_dispatch(x), rank=r)
"""
from .codec import bf16_to_f32, decode, e4m3_to_f32, encode, f32_to_bf16
from .golden import FORMAT, Entry, Golden, GoldenError, open, open_all

__all__ = ["FORMAT", "Entry", "Golden", "GoldenError", "open", "open_all",
           "bf16_to_f32", "f32_to_bf16", "e4m3_to_f32", "decode", "encode"]
__version__ = "0.1.0"
