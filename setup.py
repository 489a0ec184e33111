"""Build hook for the native kernels (everything else lives in pyproject.toml).

The cffi extension `ktinject.native._ktkernels` is compiled from `native/*.c`. When no
compiler is present or the build fails, the package still installs: the failure is logged and
`ktinject.native` reports the native path as missing (operators that need it raise a
`NativeError` with the reason, and `ktinject doctor` shows it).
"""
import logging

from setuptools import setup
from setuptools.command.build_ext import build_ext

log = logging.getLogger("ktinject.setup")


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed native build into a warning."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler, missing headers, ...
            log.warning("ktinject: native kernels not built (%s); the CPU expert operators will be unavailable", exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            log.warning("ktinject: building %s failed (%s); the CPU expert operators will be unavailable",
                        ext.name, exc)


setup(
    cffi_modules=["ktinject/native/build.py:ffibuilder"],
    cmdclass={"build_ext": OptionalBuildExt},
)
