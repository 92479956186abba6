"""Build hook for the one C extension; everything else is in pyproject.toml.

The extension (region-of-interest JPEG decode, stallfree/gpu_decode/_turbo.c) is optional: without
a compiler or libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev) the build goes on without it
and the CPU decoder uses PIL instead (ImageDecode(...).stats()["jpeg_library"] says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stallfree.gpu_decode._turbo",
            ["stallfree/gpu_decode/_turbo.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
