"""moeverify's Python side: read a golden folder written by `moeverify
export`, run your implementation on its inputs, and write its outputs where
`moeverify check` judges them (docs/contract.md §15).

    import moeverify
    for g in moeverify.open_all("golden"):
        for r in range(g.ranks):
            x = g.input("x", rank=r)                     # float32 (bf16 decoded)
            g.write("dispatch.routed_input", my_dispatch(x), rank=r)
        g.check()                                        # AssertionError naming the failing stages

    moeverify.main(fn)    # fn(golden) as a command: `prog CASE_DIR` or `prog --serve` (fuzz --impl --worker)
    moeverify.fuzz(fn, profile="torchtitan", seconds=300)   # property-based fuzzing of fn
"""
from .codec import bf16_to_f32, decode, e4m3_to_f32, encode, f32_to_bf16
from .golden import FORMAT, Entry, Golden, GoldenError, open, open_all
from .impl import Unsupported, Verdict, binary, check, export, fuzz, main, serve

__all__ = ["FORMAT", "Entry", "Golden", "GoldenError", "open", "open_all",
           "bf16_to_f32", "f32_to_bf16", "e4m3_to_f32", "decode", "encode",
           "Unsupported", "Verdict", "binary", "check", "export", "fuzz", "main", "serve"]
__version__ = "0.1.0"
