"""Build hook for the one C extension; everything else is in pyproject.toml.

The extension (region-of-interest JPEG decode, stallfree/gpu_decode/_turbo.c) is optional: without
a compiler or libjpeg-turbo's headers (Debian: libjpeg62-turbo-dev) the build goes on without it
and the CPU decoder uses PIL instead, several times slower per image. That must not pass unseen:
a failed build prints what is missing and how to fix it (pip shows it with -v), and at run time
``stallfree --version``, ``stallfree doctor`` and a one-time warning in the decoder say which
decoder runs and why (stallfree/gpu_decode/jpeg_info.py).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildOptionalExt(build_ext):
    """setuptools' build_ext, saying loudly (not in a one-line warning) when the optional
    extension fails, before setuptools goes on without it."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            if getattr(ext, "optional", False):
                print(
                    f"\n*** stallfree: the C JPEG decoder {ext.name} did not build ({exc}).\n"
                    "*** JPEGs will be decoded with PIL, several times slower per image.\n"
                    "*** Fix: install gcc and libjpeg-turbo's headers (Debian: apt-get install gcc "
                    "libjpeg62-turbo-dev), then reinstall stallfree; `stallfree doctor` checks it.\n",
                    file=sys.stderr,
                )
            raise


setup(
    cmdclass={"build_ext": BuildOptionalExt},
    ext_modules=[
        Extension(
            "stallfree.gpu_decode._turbo",
            ["stallfree/gpu_decode/_turbo.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3", "-fno-strict-aliasing"],
            optional=True,
        )
    ],
)
