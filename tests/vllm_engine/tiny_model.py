"""Writes a tiny random-weight Qwen2-VL (config, image processor, tokenizer) to a folder, with no hub:
vLLM loads it with ``load_format="dummy"``, so no weights are written. Text model of 2 layers and
hidden size 128 (4 heads of 32, the CPU attention's smallest head), vision tower of depth 2; a 56x56
image becomes 4 image tokens. The tokenizer is a word-level one over ``w0``..``w479`` and Qwen's
special tokens."""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(480)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    _json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<unk>", "bos_token": None, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE})
    text = {"model_type": "qwen2_vl_text", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "bos_token_id": vocab["<|endoftext|>"], "eos_token_id": vocab["<|im_end|>"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
            "torch_dtype": "bfloat16"}
    vision = {"model_type": "qwen2_vl_vision", "depth": 2, "embed_dim": 64, "hidden_size": 128, "mlp_ratio": 2,
              "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "hidden_act": "quick_gelu"}
    _json(out / "config.json", {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "image_token_id": vocab["<|image_pad|>"], "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"], "vision_end_token_id": vocab["<|vision_end|>"],
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "text_config": text, "vision_config": vision})
    _json(out / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True})
    _json(out / "generation_config.json", {"eos_token_id": vocab["<|im_end|>"], "bos_token_id": vocab["<|endoftext|>"]})


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1))


if __name__ == "__main__":
    write(Path(sys.argv[1]))
