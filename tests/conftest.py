import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "bpe")


@pytest.fixture(scope="session")
def mistral_sp_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", "sentencepiece")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", "bpe",
                              tie_word_embeddings=True)
