"""CUDA kernels, built on first use through torch's extension machinery (see build.py).

Every kernel has a PyTorch reference path elsewhere in quantkit; callers ask `build.load(name)`
for the compiled module and fall back to the reference when it returns None.
"""
