"""Prints the root of the nvidia-cublas wheel installed beside PyTorch (its include/ and lib/), or
nothing when there is none; for machines whose CUDA toolkit lacks cuBLAS.

    python3 bench/tools/cublas_root.py
"""

import glob
import os
import site

for packages in site.getsitepackages():
    found = glob.glob(os.path.join(packages, "nvidia", "*", "include", "cublas_v2.h"))
    if found:
        print(os.path.dirname(os.path.dirname(found[0])))
        break
