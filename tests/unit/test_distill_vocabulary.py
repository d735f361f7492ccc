"""Which logits distillation compares when the student's and the teacher's output layers differ."""

import pytest

from RL2.config import ConfigError
from RL2.trainer.distill import shared_vocabulary


def test_matching_output_layers_compare_every_logit():
    assert shared_vocabulary(49152, 49152, 49152, tp_size=2) is None


def test_padded_output_layers_compare_the_tokenizers_tokens():
    assert shared_vocabulary(151936, 152064, 151665, tp_size=1) == 151665


def test_models_that_do_not_cover_the_tokenizer_or_split_differently_are_refused():
    with pytest.raises(ConfigError, match=r"fewer than the tokenizer's 50000 tokens: "
                                          r"the models do not share a tokenizer"):
        shared_vocabulary(49152, 152064, 50000, tp_size=1)
    with pytest.raises(ConfigError, match=r"split differently over actor\.tp_size=2; distil with actor\.tp_size=1"):
        shared_vocabulary(151936, 152064, 151665, tp_size=2)
