"""Facts a checkpoint file does not carry, filled from each family's published config.

This is the ONE place where longattn supplies architecture data that the file lacks.
Everything here is checked against transformers in the tests (tests/core/test_oracle_real.py,
tests/core/test_gguf_gemma3.py).

Gemma 3 GGUF files store ``sliding_window`` (512), the global layers' rope base and scaling
(``rope.freq_base``, ``rope.scaling.*``) and, from llama.cpp's converter, the local layers'
base (``rope.freq_base_swa``), but not always the local/global layer pattern. Where the file
lacks them, transformers' ``Gemma3TextConfig`` supplies them (``sliding_window_pattern = 6``:
``layer_types[i] = "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"``; local
base ``rope_local_base_freq = 10000.0``), as llama.cpp's Gemma 3 loader does. A file without
a sliding window has no local layers (llama.cpp runs every layer global).
"""

GEMMA3_GLOBAL_EVERY = 6            # layer i is global when (i + 1) % 6 == 0
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # rope base on sliding (local) layers
GEMMA3_27B_LAYERS = 62


def gemma3_global_layers(pattern, num_layers: int, windowed: bool) -> list:
    """``[L]`` bool: layer i is global (full attention). ``pattern`` is the file's
    ``attention.sliding_window_pattern``: a per-layer list (true = local), a period ``n``
    (layer i local unless ``(i + 1) % n == 0``; 0 = every layer local), or None (period 6).
    Without a window (``windowed`` false) every layer is global."""
    if not windowed:
        return [True] * num_layers
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"attention.sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return [not bool(p) for p in pattern]
    n = GEMMA3_GLOBAL_EVERY if pattern is None else int(pattern)
    return [n != 0 and (i + 1) % n == 0 for i in range(num_layers)]


def gemma3_query_pre_attn_scalar(num_layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """The published Gemma 3 configs' query_pre_attn_scalar: head_dim (256), except
    hidden_size / heads (5376 / 32 = 168) for gemma-3-27b, the 62-layer model -- the rule
    llama.cpp's Gemma 3 loader applies."""
    return float(hidden // heads) if num_layers == GEMMA3_27B_LAYERS else float(head_dim)


# Gemma 2 GGUF files store the window and both soft-caps, but neither the layer pattern, the
# rope base nor query_pre_attn_scalar. transformers' ``Gemma2Config`` supplies the first two
# (``layer_types[i] = "sliding_attention" if (i + 1) % 2 else "full_attention"``, i.e. even
# layers local; ``rope_theta = 10000.0``; ``sliding_window = 4096`` if the file lacks it). The published configs give query_pre_attn_scalar:
# head_dim (256) for gemma-2-2b and -9b, hidden_size / heads (4608 / 32 = 144) for
# gemma-2-27b, the 46-layer model -- the same rule llama.cpp's Gemma 2 loader applies.
GEMMA2_ROPE_THETA = 10000.0
GEMMA2_WINDOW = 4096  # Gemma2Config.sliding_window, for a file without attention.sliding_window
GEMMA2_27B_LAYERS = 46


def gemma2_layer_is_global(i: int) -> bool:
    return i % 2 == 1


def gemma2_query_pre_attn_scalar(num_layers: int, hidden: int, heads: int, head_dim: int) -> float:
    return float(hidden // heads) if num_layers == GEMMA2_27B_LAYERS else float(head_dim)

# The Gemma 3 GGUF carries no ``tokenizer.chat_template``. Gemma's published turn format
# (model card "Prompt format"): each turn is ``<start_of_turn>{role}\n{text}<end_of_turn>\n``
# with roles "user" and "model", after <bos>; generation starts after ``<start_of_turn>model\n``.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
