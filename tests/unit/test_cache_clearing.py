"""`close_process_groups` empties torch.distributed's functools caches by walking its modules: the walk
reads no other attribute, so nothing torch deprecated warns in every finished run's output."""

import functools
import warnings

import torch.distributed.tensor  # noqa: F401 (the modules whose caches hold device meshes)
from torch.distributed import distributed_c10d

from RL2.parallel import _clear_dtensor_caches


def test_the_walk_warns_nothing_and_empties_a_cache_of_a_class():
    class Holder:  # as torch's classes keep their caches: a cached static method
        @staticmethod
        @functools.lru_cache
        def cached(x):
            return x

    Holder.__module__ = Holder.cached.__module__ = "torch.distributed.test_holder"
    distributed_c10d._rl2_test_holder = Holder
    try:
        Holder.cached(1)
        assert Holder.cached.cache_info().currsize == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _clear_dtensor_caches()
        assert Holder.cached.cache_info().currsize == 0
    finally:
        del distributed_c10d._rl2_test_holder
