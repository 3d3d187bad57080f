# The one version source: setup.py reads it and compiles it into pydflash._C.
__version__ = "0.1.0"
