"""Only for the optional C accelerator of the dispatcher's hottest path; everything else is in pyproject.toml.

If no C compiler is available the build goes on without it and hyper_parallel runs the same path in Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("hyper_parallel.dispatch._fastpath", ["hyper_parallel/dispatch/_fastpath.c"],
                             optional=True)])
