import pytest

from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tok():
    from tests.helpers.tiny import tokenizer

    return tokenizer()
