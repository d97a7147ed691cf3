"""Each family's config.json fields and the value transformers gives a field config.json lacks.

``FIELDS[family]`` holds every field of the family's transformers config class (the class named
in ``CONFIG_CLASS``), each with that class's default; ``OLDER_KEYS[family]`` the older keys
the class still reads into ``rope_parameters`` (``rope_theta``, ``rope_scaling``, ...), with
the default each one stands for. ``tests/core/test_hf_fields.py`` compares both tables with
transformers' classes, so a release that adds a field or changes a default fails a test.

``Fields(d, family)`` reads a config.json dict through the table: a field config.json lacks is
the class default, and a field the family's class does not have cannot be read at all (Llama
has no ``hidden_activation``; Gemma has no ``hidden_act``). Reading itself is
``hf_dir.read_hf_config``; what each field does there is in docs/families.md (Config audit).
"""

from __future__ import annotations
# longattn family -> transformers config class (transformers 5.23)
CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                "qwen3": "Qwen3Config", "phi3": "Phi3Config", "gemma2": "Gemma2Config",
                "gemma3": "Gemma3TextConfig", "gpt_oss": "GptOssConfig"}

# Shared by every class except where a family's entry overrides it.
_INERT = {"initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0}

FIELDS = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
        "attention_bias": False, "mlp_bias": False, **_INERT},
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False, "rope_parameters": None, "sliding_window": 4096,
        **_INERT},
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **_INERT},
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None, **_INERT},
    "phi3": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "hidden_act": "silu", "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "rope_parameters": None, "bos_token_id": 1,
        "eos_token_id": 32000, "pad_token_id": 32000, "sliding_window": None, **_INERT},
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-06,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
        "rope_parameters": None, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None, **_INERT},
    "gemma3": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
        "rope_parameters": None, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False, **_INERT},
    "gpt_oss": {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
        "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "sliding_window": 128,
        "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_parameters": None, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "layer_types": None, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None, "attention_bias": True, **_INERT},
}

# Older keys the class reads into rope_parameters (or, for Gemma 3's sliding_window_pattern,
# into layer_types), with the value each stands for when config.json lacks it: the class's
# ``default_theta`` (Gemma 3: global and local), Phi-3's partial_rotary_factor of 1.
_OLDER = {"rope_theta": 10000.0, "rope_scaling": None, "partial_rotary_factor": None}
OLDER_KEYS = {
    **{f: _OLDER for f in ("llama", "mistral", "qwen2", "qwen3", "gemma2")},
    "phi3": {**_OLDER, "partial_rotary_factor": 1.0},
    "gemma3": {**_OLDER, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6},
    "gpt_oss": {**_OLDER, "rope_theta": 150000.0},
}

# GptOssConfig's rope_parameters when config.json gives none (its __post_init__).
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}

# Sizes a default cannot describe: the stored weights have the checkpoint's own shapes, so a
# config.json without one is refused (naming the key) rather than given the class default.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class Fields:
    """A config.json dict read as ``family``'s transformers config class reads it.

    ``fields(name)``: config.json's value, or the class default when it lacks the key.
    ``name in fields``: config.json sets the key. Reading a name the family's class does not
    have is a programming error (ValueError), so no family reads another family's field.
    """

    def __init__(self, d: dict, family: str):
        self.d, self.family = d, family
        self.table = {**FIELDS[family], **OLDER_KEYS[family]}

    def __call__(self, name: str):
        if name not in self.table:
            raise ValueError(f"transformers' {CONFIG_CLASS[self.family]} has no field '{name}'")
        if name in REQUIRED and name not in self.d:
            raise KeyError(name)  # hf_dir names the file and the key
        return self.d.get(name, self.table[name])

    def __contains__(self, name: str) -> bool:
        return name in self.d

    def has_field(self, name: str) -> bool:
        """The family's class has the field ``name`` (its model reads it)."""
        return name in FIELDS[self.family]
