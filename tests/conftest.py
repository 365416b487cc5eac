"""Without a GPU, Triton kernels run under the Triton interpreter.

triton.jit reads TRITON_INTERPRET when a function is defined, triton's own library functions
(tl.max, tl.zeros_like, ...) included, so it must be set before anything imports triton, and
other test packages import it indirectly (transformers does). Hence here, at the root, before
any test module is collected; and only when CUDA is unavailable: on a GPU the same tests run
the compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines price drafts with the declared step costs, not ones learned from this machine's load
# (spec_decode/cost_learner.py): a test's drafting must not depend on what ran beside it.
# tests/spec_decode/test_step_costs.py turns learning back on where it tests it.
os.environ["VERISPEC_LEARN_COSTS"] = "0"
