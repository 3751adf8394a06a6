"""Comfy-Org Qwen3-VL text-encoder single files (bf16, int8_convrot, nvfp4_awq), tiny versions written by the tests
in the published schema (flat Qwen2-VL names, vision tower, no final norm / LM head), load into transformers."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.models.h3.checkpoint import CheckpointError
from engine.models.h3.conditioner import (IMAGE_PAD, TINY_SPECIALS, VIDEO_PAD, VISION_END, VISION_START,
                                          Conditioner, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                                          build_tiny_image_processor, build_tiny_tokenizer,
                                          comfy_text_encoder_name, qwen3vl_32b_config,
                                          text_encoder_file_tensors)
from engine.quant import int8_convrot, nvfp4

LAYERS = 2
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def tiny_config(layers=LAYERS):
    """Input widths 256 / 512: ConvRot's 256 groups hold."""
    ids = {t: 256 + i for i, t in enumerate(TINY_SPECIALS)}
    return Qwen3VLConfig(
        text_config=dict(vocab_size=256 + len(TINY_SPECIALS), hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                         max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[32, 16, 16],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=256,
                           num_position_embeddings=64, deepstack_visual_indexes=[1]),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END])


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer().save_pretrained(folder / "tokenizer")
    build_tiny_image_processor().save_pretrained(folder / "processor")
    return folder


def bf16_tensors(model):
    return text_encoder_file_tensors(model)


def marker(d):
    return torch.tensor(list(json.dumps(d).encode()), dtype=torch.uint8)


def linear_names(layers=LAYERS):
    return [f"model.layers.{i}.{n}" for i in range(layers) for n in LINEARS]


def nvfp4_quantize(w):
    """An NVFP4 exporter written for the test: (packed, swizzled block scales, scale_2, the decoded weight)."""
    n, k = w.shape
    scale_2 = w.abs().amax() / (6 * 448)
    blocks = w.float().view(n, k // 16, 16)
    block_scale = (blocks.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    scaled = blocks / (block_scale.float() * scale_2)[..., None].clamp(min=1e-30)
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).reshape(n, k)
    decoded = (grid[magnitude] * torch.where(scaled < 0, -1.0, 1.0)).reshape(n, k // 16, 16)
    decoded = (decoded * (block_scale.float() * scale_2)[..., None]).reshape(n, k)
    packed = (codes[:, 0::2] * 16 + codes[:, 1::2]).to(torch.uint8)  # high nibble = first element
    rows, cols = nvfp4.stored_shapes(n, k)[1]
    padded = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    padded[:n, :k // 16] = block_scale
    tiles = padded.view(torch.uint8).reshape(rows // 128, 128, cols // 4, 4).permute(0, 2, 1, 3)
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(rows, cols).view(torch.float8_e4m3fn)
    return packed, swizzled, scale_2.float(), decoded


def encode(conditioner):
    return conditioner.encode("a red ball bounces")[0]


def test_32b_config_has_the_published_tensor_count():
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(qwen3vl_32b_config())
    keys = [k for k in model.state_dict() if k not in ("lm_head.weight", "model.language_model.norm.weight")]
    assert len(keys) == 902 and sum(k.startswith("model.visual.") for k in keys) == 351  # the bf16 file's counts
    assert comfy_text_encoder_name("model.language_model.layers.49.self_attn.q_proj.weight") == \
        "model.layers.49.self_attn.q_proj.weight"
    assert comfy_text_encoder_name("model.visual.deepstack_merger_list.0.norm.weight") == \
        "visual.deepstack_merger_list.0.norm.weight"


def test_bf16_file_matches_the_model(source, tokenizer_dir, tmp_path):
    path = tmp_path / "qwen3vl_32b_minimax_h3_bf16.safetensors"
    save_file(bf16_tensors(source), path)
    loaded = Conditioner.from_single_file(path, tokenizer_dir, tiny_config(), dtype=torch.bfloat16, layer=LAYERS)
    # the same weights through the models-folder loader (transformers' from_pretrained)
    folder = tmp_path / "models"
    copy.deepcopy(source).to(torch.bfloat16).save_pretrained(folder / "text_encoder")
    for part in ("tokenizer", "processor"):
        shutil.copytree(tokenizer_dir / part, folder / part)
    reference = Conditioner.from_pretrained(folder, dtype=torch.bfloat16, layer=LAYERS)
    assert torch.equal(encode(loaded), encode(reference))


def test_int8_convrot_file(source, tokenizer_dir, tmp_path):
    tensors = bf16_tensors(source)
    for name in linear_names():
        tensors[name + ".weight"], tensors[name + ".weight_scale"] = int8_convrot.quantize_weight(
            tensors[name + ".weight"].float())
        tensors[name + ".comfy_quant"] = marker({"format": "int8_tensorwise", "convrot": True,
                                                 "convrot_groupsize": 256})
    path = tmp_path / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors"
    save_file(tensors, path)
    loaded = Conditioner.from_single_file(path, tokenizer_dir, tiny_config(), dtype=torch.float32, layer=LAYERS)
    layer = loaded.model.model.language_model.layers[1].mlp.down_proj
    assert isinstance(layer, int8_convrot.Int8ConvRotLinear) and layer.weight.dtype == torch.int8
    fp32 = Conditioner.from_single_file(save_bf16(source, tmp_path), tokenizer_dir, tiny_config(),
                                        dtype=torch.float32, layer=LAYERS)
    err = ((encode(loaded) - encode(fp32)).norm() / encode(fp32).norm()).item()
    print(f"text encoder int8_convrot vs bf16 weights: {err:.4f}")
    assert err < 0.02


def save_bf16(source, tmp_path):
    path = tmp_path / "bf16.safetensors"
    save_file(bf16_tensors(source), path)
    return path


def test_nvfp4_awq_file(source, tokenizer_dir, tmp_path):
    tensors = bf16_tensors(source)
    decoded = {}
    for name in linear_names():
        w = tensors[name + ".weight"].float()
        pre = None
        if name.endswith(("o_proj", "down_proj")):  # AWQ: the file holds W / s, the runtime scales x by s
            pre = (torch.rand(w.shape[1]) + 0.5).bfloat16()
            tensors[name + ".pre_quant_scale"] = pre
            w = w / pre.float()
        packed, scales, scale_2, decoded[name] = nvfp4_quantize(w)
        tensors.update({name + ".weight": packed, name + ".weight_scale": scales, name + ".weight_scale_2": scale_2,
                        name + ".comfy_quant": marker({"format": "nvfp4", "full_precision_matrix_mult": True})})
        if pre is not None:
            decoded[name] = decoded[name] * pre.float()
    embed = "model.embed_tokens"
    tensors[embed + ".weight"], tensors[embed + ".weight_scale"] = int8_convrot.quantize_rows(
        tensors[embed + ".weight"].float())
    tensors[embed + ".comfy_quant"] = marker({"format": "int8_tensorwise"})
    path = tmp_path / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
    save_file(tensors, path)
    loaded = Conditioner.from_single_file(path, tokenizer_dir, tiny_config(), dtype=torch.float32, layer=LAYERS)
    lm = loaded.model.model.language_model
    for name in linear_names():
        i, rest = name.split(".")[2], name.split(".", 3)[3]
        assert torch.equal(lm.layers[int(i)].get_submodule(rest).weight, decoded[name]), name
    q, s = tensors[embed + ".weight"], tensors[embed + ".weight_scale"]
    assert torch.equal(lm.embed_tokens.weight, q.float() * s)
    fp32 = Conditioner.from_single_file(save_bf16(source, tmp_path), tokenizer_dir, tiny_config(),
                                        dtype=torch.float32, layer=LAYERS)
    err = ((encode(loaded) - encode(fp32)).norm() / encode(fp32).norm()).item()
    print(f"text encoder nvfp4_awq vs bf16 weights: {err:.4f}")
    assert err < 0.3


@pytest.mark.parametrize("defect", ["missing", "dtype", "scale_shape", "unexpected"])
def test_named_errors(source, tokenizer_dir, tmp_path, defect):
    tensors = bf16_tensors(source)
    name = "model.layers.1.mlp.up_proj"
    tensors[name + ".weight"], tensors[name + ".weight_scale"] = int8_convrot.quantize_weight(
        tensors[name + ".weight"].float())
    tensors[name + ".comfy_quant"] = marker({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256})
    if defect == "missing":
        tensors.pop("visual.blocks.1.attn.qkv.bias")
        message = r"missing key 'visual.blocks.1.attn.qkv.bias' \(looked in: te.safetensors\)"
    elif defect == "dtype":
        tensors[name + ".weight_scale"] = tensors[name + ".weight_scale"].half()
        message = rf"wrong dtype for '{name}.weight_scale' in te.safetensors: file has F16, expected F32"
    elif defect == "scale_shape":
        tensors[name + ".weight_scale"] = tensors[name + ".weight_scale"].flatten()
        message = rf"shape mismatch for '{name}.weight_scale' in te.safetensors: file has \[512\], model expects " \
                  r"\[512, 1\]"
    else:
        tensors["model.norm.weight"] = torch.ones(256)
        message = r"te.safetensors: unexpected key 'model.norm.weight'"
    path = tmp_path / "te.safetensors"
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=message):
        Conditioner.from_single_file(path, tokenizer_dir, tiny_config(), layer=LAYERS)


def qwen25_like_tokenizer(directory, extra=()):
    """A tokenizer folder with Qwen2.5's token count (151 643 BPE tokens + 22 specials), as ComfyUI ships
    comfy/text_encoders/qwen25_tokenizer, plus `extra` added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"w{i}": i for i in range(len(vocab), 151643)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|s{i}|>" for i in range(19)])
    tok.add_tokens(list(extra))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
    return directory


def test_qwen25_tokenizer_files_get_the_qwen3_and_h3_tokens_at_their_ids(tmp_path):
    from engine.models.h3.conditioner import H3_ADDED, QWEN3_ADDED, load_image_processor, load_tokenizer

    tokenizer = load_tokenizer(qwen25_like_tokenizer(tmp_path / "qwen25"))
    vocab = tokenizer.get_vocab()
    assert [vocab[t] for t in QWEN3_ADDED + H3_ADDED] == list(range(151665, 151676))  # specs/h3.md §4
    assert tokenizer("<|lyrics_start|>la<|lyrics_end|>", add_special_tokens=False)["input_ids"][0] == 151672
    processor = load_image_processor(tmp_path / "qwen25")  # no preprocessor config there: Qwen3-VL's geometry
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
    assert list(processor.image_mean) == [0.5] * 3

    shifted = qwen25_like_tokenizer(tmp_path / "shifted", extra=["<d>"])  # H3's first token at a wrong id
    with pytest.raises(CheckpointError, match="'<d>' at id 151665, not 151669"):
        load_tokenizer(shifted)


def test_released_text_encoder_file_without_a_tokenizer_is_refused(tmp_path):
    path = tmp_path / "qwen3vl_32b_minimax_h3_bf16.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(151936, 8, dtype=torch.bfloat16)}, path)
    with pytest.raises(CheckpointError, match="holds no tokenizer; give the tokenizer folder"):
        Conditioner.from_single_file(path)
