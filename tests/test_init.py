"""The package's import-time set-up (src/orbitflow/__init__.py): a reproducible CPU BLAS."""

import os
import subprocess
import sys

# A fresh process: import orbitflow first, as every entry point does, then attention rows on 2 intra-op threads in one
# call and one call each. Prints MKL_CBWR, MKL's mode (-1 without an MKL in torch) and whether the rows are equal.
_PROBE = """
import ctypes, os
import orbitflow  # noqa: F401
import torch
from torch.nn import functional as F

lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
mode = lib.mkl_serv_cbwr_get(1) if hasattr(lib, "mkl_serv_cbwr_get") else -1
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
# SmolLM2-135M's grouping: 3 KV heads, 3 query heads each; 4 rows of 40 keys
q = torch.randn(4, 3, 3, 64, generator=gen)
k, v = torch.randn(4, 3, 40, 64, generator=gen), torch.randn(4, 3, 40, 64, generator=gen)
together = F.scaled_dot_product_attention(q, k, v)
alone = torch.cat([F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(4)])
print(os.environ.get("MKL_CBWR"), mode, torch.equal(together, alone))
"""


def _probe(env: dict) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}


def test_importing_orbitflow_makes_mkl_reproducible_and_rows_batch_invariant():
    """Without MKL_CBWR, MKL picked its kernels by buffer alignment: on an AVX-512 AMD EPYC an attention row that
    another intra-op thread computed differed in the last bit from the same row in a call of its own. Importing
    orbitflow sets AUTO before torch's first matmul, and the rows are equal."""
    value, mode, equal = _probe(_clean_env())
    assert value == "AUTO"
    if mode != "-1":  # torch built with MKL: its mode is AUTO (MKL_CBWR_AUTO = 2), not branch-off (1)
        assert mode == "2"
    assert equal == "True"


def test_a_mkl_cbwr_the_user_set_is_kept():
    value, mode, _ = _probe({**_clean_env(), "MKL_CBWR": "COMPATIBLE"})
    assert value == "COMPATIBLE"
    if mode != "-1":
        assert mode == "3"  # MKL_CBWR_COMPATIBLE
