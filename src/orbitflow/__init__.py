"""OrbitFlow: SLO-aware long-context LLM serving with per-request, per-layer KV cache placement."""

import os

# Reproducible CPU BLAS. torch's CPU matmuls (and its flash-attention kernel's) go to MKL, which by default picks its
# code path by the alignment of the buffers it gets: on an AVX-512 AMD EPYC one attention row came out a bit apart
# when another intra-op thread (another scratch buffer) computed it, so a decode row batched with others was not the
# row alone bit for bit (tests/model/test_attention.py). MKL's Conditional Numerical Reproducibility in AUTO mode keeps
# its instruction-set dispatch and fixes each result for a given thread count; on that machine it also made decode
# about 1.5x faster, for transformers as for us (docs/architecture.md, "Numerics"). MKL reads the variable at its
# first call, so it is set here, before any orbitflow module runs torch; a value the user set wins.
os.environ.setdefault("MKL_CBWR", "AUTO")
