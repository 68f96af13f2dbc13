import shutil

import pytest
import torch

from blockscope.errors import BlockscopeError
from blockscope.model.loading import load_model, resolve_device, spec_for


def test_loads_local_checkpoint_raw_eval_fp32(tiny, tiny_dir):
    assert tiny.cfg.n_layers == 3 and tiny.cfg.d_model == 64 and tiny.cfg.n_heads == 4
    assert not tiny.training
    assert next(tiny.parameters()).dtype == torch.float32
    spec = spec_for(str(tiny_dir))
    assert spec.is_local and spec.slug == "tiny-gpt2" and spec.device == "cpu"


def test_hub_id_spec_is_not_local():
    spec = spec_for("openai-community/gpt2", device="cpu")
    assert not spec.is_local and spec.slug == "openai-community--gpt2"


def pickle_only_copy(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    d = tmp_path / "pickled"
    shutil.copytree(tiny_dir, d)
    state = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    return d


def test_pickle_weights_refused_unless_allowed(tiny_dir, tmp_path, hf):
    d = pickle_only_copy(tiny_dir, tmp_path)
    with pytest.raises(BlockscopeError, match="pass allow_pickle") as refused:
        load_model(spec_for(str(d), device="cpu"))
    assert "pass --allow-pickle" in refused.value.as_flag()  # as the command line says it
    model = load_model(spec_for(str(d), device="cpu"), allow_pickle=True)
    ids = torch.tensor([[50256, 464, 3139, 286, 4881, 318]])
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-4)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(BlockscopeError, match="config.json"):
        load_model(spec_for(str(tmp_path), device="cpu"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(BlockscopeError, match="not a directory"):
        load_model(spec_for(str(f), device="cpu"))


def test_truncated_weights(tiny_dir, tmp_path):
    d = tmp_path / "truncated"
    shutil.copytree(tiny_dir, d)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(BlockscopeError, match="cannot (read|load) the checkpoint"):
        load_model(spec_for(str(d), device="cpu"))


def test_unknown_model_offline_names_it_and_the_way_out():
    with pytest.raises(BlockscopeError, match="no-such-org/no-such-model.*run with model ") as e:
        load_model(spec_for("no-such-org/no-such-model", device="cpu"))
    assert "run with --model smollm2-135m" in e.value.as_flag()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device, message", [("cuda", "no CUDA"), ("cuda:3", "no CUDA"),
                                             ("tpu9", "unknown device")])
def test_devices_this_machine_lacks(device, message):
    with pytest.raises(BlockscopeError, match=message):
        resolve_device(device)


def test_auto_device_and_dtypes():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(BlockscopeError, match="dtype"):
        spec_for("gpt2", dtype="float8")


def test_one_table_reads_every_familys_sizes():
    """arch.config_get: the one place the config keys are spelled, for config objects and
    config.json dicts alike, a multimodal config's text_config first."""
    from transformers import GPT2Config, LlamaConfig

    from blockscope.model.arch import config_get

    gpt2 = GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=128)
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                        intermediate_size=88, max_position_embeddings=64)
    assert [config_get(gpt2, k) for k in ("n_layers", "d_model", "n_heads", "n_ctx")] == [
        3, 64, 4, 128]
    assert config_get(gpt2, "d_mlp", 256) == 256  # n_inner unset: 4 d_model, as given
    assert [config_get(llama, k) for k in ("n_layers", "d_model", "d_mlp", "eps")] == [
        2, 32, 88, llama.rms_norm_eps]
    wrapped = {"model_type": "gemma3", "text_config": llama.to_dict()}
    assert config_get(wrapped, "n_ctx") == 64 and config_get({}, "n_heads") is None
