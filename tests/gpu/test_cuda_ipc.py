"""A CUDA-IPC weight bucket read by another process after the producer let go of the tensors it was made of.

The producer flattens a bucket of CUDA tensors (the full tensors a weight sync gathers), serializes it
in SGLang's payload format, drops the tensors and fills the freed memory with other data, as the next
bucket would. A separate process (standing in for a server: it maps CUDA IPC handles by device
UUID, as SGLang's patched `rebuild_cuda_tensor` does) rebuilds the named tensors from the payload and
must read the original values: the flat copy the bucket keeps alive until then is what it maps.
"""

import subprocess
import sys

import pytest
import torch

from RL2.engine.sglang.weight_transfer import flatten_bucket, serialize_flat_bucket

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

READER = r"""
import base64, io, pickle, sys
import torch
from torch.multiprocessing import reductions

def rebuild_by_uuid(*args):
    # As SGLang's _rebuild_cuda_tensor_modified: argument 6 names the GPU by UUID.
    device = next(i for i in range(torch.cuda.device_count())
                  if str(torch.cuda.get_device_properties(i).uuid) == args[6])
    return reductions.rebuild_cuda_tensor(*args[:6], device, *args[7:])

class Reader(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return rebuild_by_uuid
        return super().find_class(module, name)

payload = Reader(io.BytesIO(base64.b64decode(open(sys.argv[1]).read()))).load()
flat = payload["flattened_tensor"]
assert flat.is_cuda
tensors = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).cpu() for m in payload["metadata"]}
torch.save(tensors, sys.argv[2])
"""


def test_bucket_read_by_another_process_after_the_producer_let_go(tmp_path):
    device = torch.device("cuda", 0)
    generator = torch.Generator(device).manual_seed(0)
    bucket = [("embed.weight", torch.randn(1000, 64, device=device, generator=generator, dtype=torch.bfloat16)),
              ("norm.weight", torch.randn(64, device=device, generator=generator)),
              ("lm_head.bias", torch.randn(1000, device=device, generator=generator, dtype=torch.float16))]
    expected = {name: tensor.cpu() for name, tensor in bucket}
    flat, metadata = flatten_bucket(bucket)
    (tmp_path / "payload.txt").write_text(serialize_flat_bucket(flat, metadata))
    del bucket  # the producer's tensors are gone ...
    garbage = [torch.full((1 << 20,), 7.0, device=device) for _ in range(8)]  # ... and their memory reused
    torch.cuda.synchronize()
    subprocess.run([sys.executable, "-c", READER, str(tmp_path / "payload.txt"), str(tmp_path / "read.pt")],
                   check=True, timeout=300)
    read = torch.load(tmp_path / "read.pt")
    assert list(read) == list(expected)
    for name, tensor in expected.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    del flat, garbage  # only now, once the reader has answered
