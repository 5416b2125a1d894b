"""The tokenizer, chat template and processor files of the scaled-down VL checkpoints (`models.tokenizer`):
the chat message of the fixed image prompt must come back as exactly the prompt's ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_impl.forward.prompts import image_prompt, text_prompts
from reference_impl.models import tokenizer
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model

VL_MODELS = ("qwen3-vl", "qwen3-vl-moe")


@pytest.fixture(scope="module", params=VL_MODELS)
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    config = load_model(request.param).config
    folder = tmp_path_factory.mktemp(request.param)
    tokenizer.write_processor_files(config, folder)
    return config, folder


def test_special_tokens_sit_at_the_configs_ids() -> None:
    for name in VL_MODELS:
        config = load_model(name).config
        text = config["text_config"]
        assert tokenizer.special_tokens(config) == {
            config["image_token_id"]: "<|image_pad|>",
            config["video_token_id"]: "<|video_pad|>",
            config["vision_start_token_id"]: "<|vision_start|>",
            config["vision_end_token_id"]: "<|vision_end|>",
            text["bos_token_id"]: "<|endoftext|>",
            text["eos_token_id"]: "<|im_end|>",
            1006: "<|im_start|>",  # the first id above the config's special ids (1000..1005)
        }
    with pytest.raises(ValueError, match="image_token_id"):
        tokenizer.special_tokens(load_model("qwen3").config)
    small = {**load_model("qwen3-vl").config}
    small["text_config"] = {**small["text_config"], "vocab_size": 1006}
    with pytest.raises(ValueError, match="do not fit"):
        tokenizer.special_tokens(small)


def test_every_id_is_one_token_and_text_round_trips(written: tuple[dict, Path]) -> None:
    from transformers import AutoTokenizer

    config, folder = written
    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = config["text_config"]["vocab_size"]
    assert len(tok) == vocab
    tokens = tok.convert_ids_to_tokens(list(range(vocab)))
    assert len(set(tokens)) == vocab
    assert tokens[17] == "t17" and tokens[config["image_token_id"]] == "<|image_pad|>"
    ids = [5, 999, 17, 1010, 0]
    assert tok(tokenizer.ordinary_text(ids), add_special_tokens=False)["input_ids"] == ids
    assert tok.eos_token_id == config["text_config"]["eos_token_id"]


@pytest.mark.parametrize("image_part", ["image_url", "image"])
def test_chat_message_of_the_image_prompt_is_its_ids(written: tuple[dict, Path], image_part: str) -> None:
    """The checkpoint's chat template renders the prompt's chat content (the image part as the client sends
    it, and as vLLM hands it to the template: {"type": "image"}); its tokenizer makes the prompt's ids with
    one image placeholder, which the processor expands to the prompt's image tokens."""
    from transformers import AutoTokenizer

    config, folder = written
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt = image_prompt(config)
    content = [
        {"type": "image"} if p["type"] == "image_url" and image_part == "image" else p for p in prompt.chat_content
    ]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == prompt.collapsed_input_ids
    assert ids.count(config["image_token_id"]) == 1
    assert ids[len(prompt.text_before)] == config["vision_start_token_id"]
    assert [x for x in prompt.input_ids if x != config["image_token_id"]] == [
        *prompt.text_before,
        config["vision_start_token_id"],
        config["vision_end_token_id"],
        *prompt.text_after,
    ]


def test_processor_configs_hold_the_fixed_prompts_image_processing(written: tuple[dict, Path]) -> None:
    from reference_impl.forward.prompts import image_processor_kwargs

    config, folder = written
    vision = config["vision_config"]
    image = json.loads((folder / "preprocessor_config.json").read_text())
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    kw = image_processor_kwargs(config)
    for body in (image, video):
        assert body["patch_size"] == vision["patch_size"] == kw["patch_size"]
        assert body["temporal_patch_size"] == vision["temporal_patch_size"]
        assert body["merge_size"] == vision["spatial_merge_size"]
        assert body["image_mean"] == body["image_std"] == [0.5, 0.5, 0.5] == kw["image_mean"]
        assert body["processor_class"] == "Qwen3VLProcessor"
    assert image["size"] == {"shortest_edge": kw["min_pixels"], "longest_edge": kw["max_pixels"]}
    assert image["image_processor_type"] == "Qwen2VLImageProcessorFast"
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"


def test_prompts_draw_no_special_token_of_the_tokenizer() -> None:
    config = load_model("qwen3-vl").config
    special = set(tokenizer.special_tokens(config))
    drawn = {x for p in text_prompts(config, n=4, length=2000, seed=3) for x in p}
    assert not drawn & special
    assert len(drawn) == config["text_config"]["vocab_size"] - len(special)  # every other id can be drawn


def test_vl_checkpoints_carry_the_files_text_checkpoints_do_not() -> None:
    vl = make_checkpoint(load_model("qwen3-vl"), 1234)
    names = {p.name for p in vl.iterdir()}
    written = {"tokenizer.json", "chat_template.jinja", "preprocessor_config.json", "video_preprocessor_config.json"}
    assert written <= names
    assert not (make_checkpoint(load_model("qwen3"), 1234) / "tokenizer.json").exists()
