"""Builds the Cython extensions in trillm/sched_ext; everything else is in pyproject.toml."""
from Cython.Build import cythonize
from setuptools import setup

setup(
    ext_modules=cythonize(
        "trillm/sched_ext/*.pyx",
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False},
    )
)
