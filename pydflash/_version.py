# The one version source: the build (pyproject.toml's [tool.scikit-build]) reads it and
# compiles it into pydflash._C.
__version__ = "0.1.0"
