"""Stand-in for vLLM's compiled ops, for SGLang on CPU in the tests only.

SGLang's rotary-embedding module imports `rotary_embedding` from here at import time when no
sgl-kernel CPU build is present; on CPU the rope runs through its `forward_native`, so this is
imported and never called. It is put on the server's PYTHONPATH by tests/e2e/test_sglang.py.
"""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("vllm is not installed; this stub only lets SGLang import on CPU")
