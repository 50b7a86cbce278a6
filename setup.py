"""The one compiled part: kvstore._int8, the int8 codec's quantizer (kvstore/_int8.c).

Optional: where it does not build (no C compiler, as in a slim image), ``pip install`` goes on and
kvstore.int8 quantizes with torch, a few times slower on the same bytes. Everything else about the
package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._int8",
            ["kvstore/_int8.c"],
            # -ffp-contract=off: no fused multiply-add, so every product rounds as torch's does and
            # the bytes match kvstore/int8.py's; the AVX2 variant is picked at import, by the CPU.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"],
            optional=True,
        )
    ]
)
