"""The compiled kernels of the lean update and the bf16 + int16 split; they import nothing of the library.

- :mod:`~lightning_mp.kernels.native`: the C kernel (``lean_update.c``), built on first use, loaded with ctypes;
- :mod:`~lightning_mp.kernels.cuda`: the Triton kernel of the same update on CUDA;
- :mod:`~lightning_mp.kernels.contract`: what both kernels must compute, bit for bit, as torch code;
- :mod:`~lightning_mp.kernels.bits`: an fp32 value as a bf16 half plus an int16 remainder, exactly.
"""
