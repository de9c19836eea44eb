"""One GGUF metadata reader (utils/gguf_header.py) behind the tokenizer, the model config and the
CLI's preflight: the header-only refusals are the same function on both sides of the process
boundary, and the worker's config reads what the header parser reads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from radix_runtime.model_source import ModelSource
from radix_runtime.utils.gguf_header import read_gguf_metadata
from radix_runtime.worker import gguf_format
from radix_runtime.worker.model_config import UnsupportedModel, preflight


def _write(path: str, arch: str = "llama", **extra) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list(["<s>", "</s>", "a", "b"])
    w.add_eos_token_id(1)
    w.add_chat_template("{{ '<|im_end|>' }}")
    if "experts" in extra:
        w.add_expert_count(extra["experts"])
    if "rope" in extra:
        w.add_rope_scaling_type(extra["rope"])
        w.add_rope_scaling_factor(4.0)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _source(path: str) -> ModelSource:
    return ModelSource(kind="gguf", path=path, name="t")


def test_config_reads_the_header_parsers_metadata(tmp_path):
    path = str(tmp_path / "m.gguf")
    _write(path)
    f = gguf_format.open_gguf(path)
    assert f.meta == read_gguf_metadata(path)
    c = gguf_format.config_from_gguf(f)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 2, 1, 4, 4)
    assert c.eos_token_ids == (1,)  # <|im_end|> is in the template but not in the vocabulary
    preflight(_source(path))  # accepted on both sides


@pytest.mark.parametrize(
    "arch,extra,words",
    [
        ("falcon", {}, "general.architecture = 'falcon'"),
        ("llama", {"experts": 8}, "llama.expert_count = 8: MoE"),
        ("llama", {"rope": gguf.RopeScalingType.LONGROPE}, "llama.rope.scaling.type = 'longrope'"),
    ],
)
def test_preflight_and_worker_refuse_alike(tmp_path, arch, extra, words):
    path = str(tmp_path / "m.gguf")
    _write(path, arch, **extra)
    with pytest.raises(UnsupportedModel, match=words) as front:
        preflight(_source(path))
    with pytest.raises(UnsupportedModel) as worker:
        gguf_format.config_from_gguf(gguf_format.open_gguf(path))
    assert str(front.value) == str(worker.value)
