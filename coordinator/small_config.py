"""A checkpoint's config.json shrunk to a model small enough to build and run in the driver in
a second: 2 decoder layers and tiny widths, changed together so the model still builds, with
its structural flags kept (sliding windows, rope type, tying, MoE routing, per-layer kinds).
The family pre-launch check (`coordinator.family_check`) runs this copy whole and split."""

from __future__ import annotations

from collections.abc import Iterator

NUM_LAYERS = 2
HIDDEN, HEADS, HEAD_DIM, FFN, LORA_RANK = 32, 4, 8, 48, 16
VOCAB, EXPERTS, EXPERTS_PER_TOKEN = 128, 4, 2
WINDOW = 4  # a sliding window the 9-token sequences below outrun
FFN_KEYS = ("ffn_dim", "n_inner", "ffn_hidden_size", "d_ff")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token")
# "Layers below this index are X": a threshold past the shrunk depth keeps every layer X,
# one inside it keeps both kinds (layer 0 X, layer 1 not).
THRESHOLD_KEYS = ("first_k_dense_replace", "max_window_layers")
# Lists of the layers that are attention layers in a mamba hybrid (Bamba, LFM2's full ones).
INDEX_LIST_KEYS = ("attn_layer_indices", "full_attn_idxs")
# "Every period-th layer from offset on is X" (Jamba's attention and expert layers).
PERIOD_KEYS = (
    ("attn_layer_period", "attn_layer_offset"),
    ("expert_layer_period", "expert_layer_offset"),
)
# Mamba-2 mixers (Bamba, Falcon-H1, Granite 4 hybrids, Nemotron-H, Zamba2): heads x head dim
# = the mixer's width (expand x hidden, or its own `mamba_d_ssm`), groups dividing the heads.
MAMBA_EXPAND_KEYS = ("mamba_expand", "expand")
MAMBA_HEADS_KEYS = ("mamba_n_heads", "mamba_num_heads")
MAMBA_HEAD_DIM_KEYS = ("mamba_d_head", "mamba_head_dim")
MAMBA_STATE_KEYS = ("mamba_d_state", "ssm_state_size", "state_size")
MAMBA_GROUP_KEYS = ("mamba_n_groups", "n_groups")
MAMBA_CHUNK_KEYS = ("mamba_chunk_size", "chunk_size")
MAMBA_STATE, MAMBA_CHUNK = 16, 4  # a chunk shorter than the prompts: the scan continues chunks


def shrink_config(config: dict, *, widths: bool = True) -> dict:
    """config.json's values with `NUM_LAYERS` decoder layers and tiny widths, shrunk together
    (heads x head dim = hidden; grouped-query and multi-query attention stay so); every other
    key, the structural flags, as it was. Per-layer lists keep a layer of each kind. With
    `widths` False only the depth, the windows and the vocabulary shrink: the layers keep the
    config's own widths (for a family whose coupled widths this cannot shrink)."""
    from transformers import CONFIG_MAPPING

    family = config["model_type"]
    aliases = getattr(CONFIG_MAPPING[family], "attribute_map", {})
    small = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}

    def key(name: str) -> str:  # the family's own spelling (GPT-2's n_embd for hidden_size)
        own = aliases.get(name, name)
        return own if own in small else name

    def ints(keys) -> Iterator[tuple[str, int]]:
        for k in keys:
            value = small.get(k)
            if isinstance(value, int) and not isinstance(value, bool):
                yield k, value

    layers_key = next(  # LongCat-Flash spells it num_layers, with no alias
        (k for k in (key("num_hidden_layers"), "num_layers", "n_layers") if k in small),
        key("num_hidden_layers"),
    )
    kinds = small.get("layer_types") or small.get("layers_block_type")
    depth = small[layers_key] if layers_key in small else len(kinds)  # Nemotron-H: the list
    hidden = small.get(key("hidden_size"))
    heads = small.get(key("num_attention_heads"))
    head_dim = small.get("head_dim") or (hidden // heads if hidden and heads else None)
    kept = _kept_layers(_layer_kinds(small, kinds, depth), depth)
    if layers_key in small:
        small[layers_key] = len(kept)
    for k, value in list(small.items()):  # per-layer lists and dicts: the kept layers' entries
        if isinstance(value, list) and len(value) == depth and not k.endswith("_token_id"):
            small[k] = [value[i] for i in kept]
        elif isinstance(value, dict) and value and all(str(i).isdigit() for i in value):
            small[k] = {type(i)(kept.index(int(i))): v for i, v in value.items() if int(i) in kept}
    for k in ("mlp_only_layers", *INDEX_LIST_KEYS):
        if isinstance(small.get(k), list):
            small[k] = [kept.index(i) for i in small[k] if i in kept]
    for period_key, offset_key in PERIOD_KEYS:  # kept: layer 0 one kind, layer 1 the other
        if isinstance(small.get(period_key), int) and small[period_key] > 1:
            small[period_key], small[offset_key] = 2, 1
    for k, value in ints(THRESHOLD_KEYS):
        small[k] = len(kept) if value >= depth else min(value, 1)
    for k, value in ints(("sliding_window", "attention_chunk_size")):
        small[k] = min(value, WINDOW)
    for k, _ in ints([key("vocab_size")]):
        small[k] = VOCAB
    for k, value in list(small.items()):  # special tokens inside the small vocabulary
        if k.endswith("_token_id"):
            small[k] = _inside_vocab(value)
    if widths:
        _shrink_widths(small, key, ints, hidden, heads, head_dim)
    return small


def _shrink_widths(small: dict, key, ints, hidden, heads, head_dim) -> None:
    for k, _ in ints([key("hidden_size")]):
        small[k] = HIDDEN
    for k, value in ints(("word_embed_proj_dim", "embedding_size")):  # projected embeddings
        small[k] = HIDDEN if value == hidden else HIDDEN // 2
    for k, _ in ints([key("num_attention_heads")]):
        small[k] = HEADS
    for k, value in ints(KV_HEAD_KEYS):  # as many as the heads, one (multi-query), or fewer
        small[k] = HEADS if value == heads else 1 if value == 1 else 2
    for k, _ in ints(["head_dim", "kv_channels", *(k for k in small if k.endswith("_head_dim"))]):
        small[k] = HEAD_DIM
    if {"qk_nope_head_dim", "qk_rope_head_dim"} <= small.keys() and "qk_head_dim" in small:
        # multi-head latent attention: a query/key head is its unrotated and rotated parts
        small["qk_head_dim"] = small["qk_nope_head_dim"] + small["qk_rope_head_dim"]
    for k, value in ints(["rotary_dim"]):  # partial rotary stays partial
        small[k] = HEAD_DIM if head_dim and value >= head_dim else HEAD_DIM // 2
    for k, _ in ints(k for k in small if k.endswith("_lora_rank")):
        small[k] = LORA_RANK
    for k, _ in ints([*(k for k in small if k.endswith("intermediate_size")), *FFN_KEYS]):
        small[k] = FFN
    for k, value in list(small.items()):  # a width per layer
        if k.endswith("intermediate_size") and isinstance(value, list):
            small[k] = [FFN if isinstance(v, int) else v for v in value]
    for k, value in ints(key(name) for name in EXPERT_KEYS):
        small[k] = min(value, EXPERTS)
    for k, value in ints(key(name) for name in TOP_K_KEYS):
        small[k] = min(value, EXPERTS_PER_TOKEN)
    for k, _ in ints(("n_group", "topk_group")):  # expert groups must divide the experts
        small[k] = 1
    _shrink_mamba(small)


def _layer_kinds(small: dict, kinds, depth: int) -> list | None:
    """Each layer's kind: the config's per-layer list, or from a list of attention layers."""
    if isinstance(kinds, list) and len(kinds) == depth:
        return kinds
    for k in INDEX_LIST_KEYS:
        if isinstance(small.get(k), list):
            return ["attention" if i in small[k] else "other" for i in range(depth)]
    period, offset = PERIOD_KEYS[0]
    if isinstance(small.get(period), int) and isinstance(small.get(offset), int):
        return [
            "attention" if i % small[period] == small[offset] else "mamba" for i in range(depth)
        ]
    return None


def _kept_layers(kinds: list | None, depth: int) -> list[int]:
    """Which of `depth` layers the shrunk model keeps: the first layer of each kind (a
    full-attention layer after sliding ones, a mamba and an attention layer of a hybrid), in
    model order; layers 0 and 1 when all are alike."""
    if depth < NUM_LAYERS:
        return list(range(depth))
    if kinds is not None:
        first = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
        if len(first) >= NUM_LAYERS:
            return first
    return [0, 1]


def _shrink_mamba(small: dict) -> None:
    """Mamba-2 mixer widths, shrunk together: heads x head dim = expand x hidden (or the
    config's own mixer width), a small state, groups that divide the heads, and chunks shorter
    than the check's prompts."""
    heads_key = next((k for k in MAMBA_HEADS_KEYS if isinstance(small.get(k), int)), None)
    if heads_key is None:
        return
    expand = next((small[k] for k in MAMBA_EXPAND_KEYS if isinstance(small.get(k), int)), 2)
    width = expand * small.get("hidden_size", HIDDEN)
    if isinstance(small.get("mamba_d_ssm"), int):
        small["mamba_d_ssm"] = width
    small[heads_key] = width // HEAD_DIM
    for k in MAMBA_HEAD_DIM_KEYS:
        if isinstance(small.get(k), int):
            small[k] = HEAD_DIM
    for keys, most in (
        (MAMBA_STATE_KEYS, MAMBA_STATE),
        (MAMBA_GROUP_KEYS, 2),
        (MAMBA_CHUNK_KEYS, MAMBA_CHUNK),
    ):
        for k in keys:
            if isinstance(small.get(k), int):
                small[k] = min(small[k], most)


def _inside_vocab(value):
    if isinstance(value, list):
        return [_inside_vocab(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
        return VOCAB - 1
    return value
