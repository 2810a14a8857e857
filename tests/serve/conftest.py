"""Fixtures the serving tests share: the tiny test model with a byte-level tokenizer and a
small chat template (the chat routes need one)."""

import pytest

from tinyloop.convert.synthetic import byte_level_tokenizer_json, synthetic_config, \
    synthetic_weights
from tinyloop.format import write_tlm

from ..conftest import TINY

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def chat_model_path(tmp_path_factory):
    """The tiny test model with a byte-level tokenizer and TEMPLATE as its chat template."""
    cfg = synthetic_config(**TINY, bos_token_id=256, eos_token_id=257)
    path = tmp_path_factory.mktemp("models") / "chat.tlm"
    write_tlm(path, cfg, synthetic_weights(cfg, 11), tokenizer_json=byte_level_tokenizer_json(
        cfg.vocab_size), chat_template=TEMPLATE)
    return str(path)
