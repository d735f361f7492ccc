"""Page-locked host buffers of an offloaded worker (`RL2.native.pinned_host`), on the CPU.

Page-locking needs CUDA (tests/gpu/test_cuda_fsdp.py runs it there); here a recording lock stands in
for `cudaHostRegister` and records which address ranges would be locked, and the copies go from CPU to
CPU. What is checked: whole pages locked once per tensor and never twice, buffers reused at every
offload, a lock that fails before anything moves, and an FSDP2 model and its optimizer whose state
was re-pointed at the buffers taking the same step as one that never moved (two ranks with an
unevenly sharded parameter, which stays out of the buffers, in tests/e2e/test_pinned_offload.py).
"""

import gc

import pytest
import torch
from torch.distributed.tensor import DTensor

from RL2.native.pinned_host import SMALL_BYTES, PinnedHostCopies, state_to_host
from tests.helpers.recording_lock import RecordingLock
from tests.unit.test_fsdp_worker import backward_nll, local, worker


def copies_with(recorder: RecordingLock) -> PinnedHostCopies:
    return PinnedHostCopies(lock=recorder.lock, unlock=recorder.unlock)


def test_each_large_tensor_gets_its_own_locked_pages_reused_at_every_copy():
    recorder = RecordingLock()
    copies = copies_with(recorder)
    large = [torch.randn(1000, 300), torch.randn(1025, 777).to(torch.bfloat16), torch.randn(SMALL_BYTES // 4)]
    small = torch.randn(10)
    hosts = [copies.copy(("t", i), t) for i, t in enumerate(large)]
    for source, host in zip(large, hosts):
        assert torch.equal(host, source) and host.data_ptr() != source.data_ptr()
        assert recorder.holds(host)
    assert recorder.calls == 3
    assert torch.equal(copies.copy("small", small), small) and recorder.calls == 3  # pageable: not locked

    # The next offload writes the same buffers: nothing new is allocated or locked.
    changed = [t * 2 for t in large]
    again = [copies.copy(("t", i), t) for i, t in enumerate(changed)]
    assert [h.data_ptr() for h in again] == [h.data_ptr() for h in hosts] and recorder.calls == 3
    assert all(torch.equal(h, t) for h, t in zip(again, changed))

    # A key whose tensor changed shape gets new pages; its old ones are unlocked.
    copies.copy(("t", 0), torch.randn(2000, 300))
    assert recorder.calls == 4 and len(recorder.locked) == 3

    del copies, hosts, again
    gc.collect()
    assert recorder.locked == {}  # all unlocked when the buffers' owner goes


def test_a_dtensor_keeps_its_placement(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    tensor = distribute_tensor(torch.randn(600, 512), mesh, [Shard(0)])
    recorder = RecordingLock()
    copies = copies_with(recorder)
    host = copies.copy("d", tensor)
    assert isinstance(host, DTensor) and host.placements == tensor.placements and host.shape == tensor.shape
    assert recorder.holds(host.to_local()) and torch.equal(host.to_local(), tensor.to_local())


def test_worker_state_moved_into_locked_buffers_takes_the_same_step(tiny_model_path, one_rank):
    moved, still = worker(tiny_model_path), worker(tiny_model_path)
    for w in (moved, still):
        backward_nll(w)
        w.optimizer_step()
    recorder = RecordingLock()
    copies = copies_with(recorder)
    for _ in range(2):  # twice: a second move of state already in its buffers leaves it there
        state_to_host(copies, moved.model, moved.optimizer)
    large = [local(p) for p in moved.model.parameters() if local(p).numel() * 4 >= SMALL_BYTES]
    moments = [local(v) for s in moved.optimizer.state.values() for v in s.values() if v.numel() * 4 >= SMALL_BYTES]
    assert large and moments and all(recorder.holds(t) for t in large + moments)
    assert recorder.calls == len(large) + len(moments)

    for w in (moved, still):
        backward_nll(w)
        w.optimizer_step()
    for a, b in zip(moved.model.parameters(), still.model.parameters()):
        assert torch.equal(local(a), local(b))
    assert all(recorder.holds(t) for t in large)  # the step updated the buffers in place


def test_a_failing_lock_leaves_the_state_where_it_was(tiny_model_path, one_rank):
    """Every buffer is locked before anything moves: the second lock failing moves nothing."""
    w = worker(tiny_model_path)
    backward_nll(w)
    w.optimizer_step()
    tensors = lambda: [local(p) for p in w.model.parameters()] + [local(v) for s in w.optimizer.state.values()
                                                                   for v in s.values()]
    before = [t.data_ptr() for t in tensors()]
    recorder = RecordingLock(fail_at=2)
    with pytest.raises(RuntimeError, match="page-lock"):
        state_to_host(copies_with(recorder), w.model, w.optimizer)
    assert [t.data_ptr() for t in tensors()] == before


def large_state(w) -> list[torch.Tensor]:
    """The local tensors of the parameters and Adam moments large enough for locked buffers."""
    tensors = [local(p) for p in w.model.parameters()]
    tensors += [local(v) for state in w.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return [t for t in tensors if t.numel() * t.element_size() >= SMALL_BYTES]


def test_worker_offload_locks_every_large_tensor_once_and_reuses_its_buffer(tiny_model_path, one_rank):
    """The CUDA path of `FSDPWorker.offload`/`onload` (tests/gpu/test_cuda_fsdp.py runs it on a GPU), on the
    CPU with a recording lock: each large tensor in its own locked pages, as `is_pinned` would see them,
    the same buffers at every offload, and the steps in between the same as a worker's that never moved."""
    moved, still = worker(tiny_model_path), worker(tiny_model_path)
    recorder = RecordingLock()
    moved.offload_into(copies_with(recorder))
    for w in (moved, still):
        backward_nll(w)
        w.optimizer_step()
    resident = [t.clone() for t in large_state(moved)]
    moved.offload()
    first = large_state(moved)
    assert len(first) == len(resident) > 0 and all(recorder.holds(t) for t in first)
    assert all(torch.equal(a, b) for a, b in zip(resident, first)) and recorder.calls == len(first)
    moved.onload()
    for w in (moved, still):
        backward_nll(w)
        w.optimizer_step()
    moved.offload()
    assert [t.data_ptr() for t in large_state(moved)] == [t.data_ptr() for t in first]  # the same buffers
    assert recorder.calls == len(first)  # nothing locked twice
    moved.onload()
    for a, b in zip(moved.model.parameters(), still.model.parameters()):
        assert torch.equal(local(a), local(b))


def test_optimizer_offloaded_between_steps_sits_in_locked_buffers_and_takes_the_same_steps(tiny_model_path, one_rank):
    """`offload_optimizer`: Adam's moments leave for their locked buffers after every step and come back for
    the next; the steps equal those of a worker that keeps them."""
    kept, offloaded = worker(tiny_model_path), worker(tiny_model_path, offload_optimizer=True)
    recorder = RecordingLock()
    offloaded.offload_into(copies_with(recorder))
    for _ in range(2):
        for w in (kept, offloaded):
            backward_nll(w)
            w.optimizer_step()
        moments = [local(v) for s in offloaded.optimizer.state.values() for v in s.values()
                   if v.numel() * v.element_size() >= SMALL_BYTES]
        assert moments and all(recorder.holds(m) for m in moments)
    assert recorder.calls == len(moments)
    for ours, theirs in zip(offloaded.model.parameters(), kept.model.parameters()):
        assert torch.equal(local(ours), local(theirs))
