"""What runs where, as data: for each model family (config.model_type), which of its modules `patch` takes over
and the opport op each one runs. Adding a family whose modules follow one of these layouts is a table entry
(plus its tests); docs/integration.md prints the table (`table_rows`).

Module kinds, by the class name after the family's prefix (transformers' own modeling file):
- `RMSNorm` -> rmsnorm (Gemma's `x̂ · (1 + weight)` as the op's offset=1.0); torch.nn.LayerNorm -> layernorm
  in layernorm families (GPT-NeoX);
- `MLP` -> swiglu (SiLU gate) or gelu (Gemma's tanh-GELU gate: gelu(gate, 'tanh') · up; GPT-NeoX's ungated
  down(gelu(up(x)))), by the activation;
- `Attention` -> rope on q and k (partial rotary where the tables cover part of the head), then attention
  (dense batches) or varlen_attention (padded and packed), with the layer's window and logit soft cap;
  fused qkv projections (Phi3) and q/k norms per head (Qwen3, Gemma3) or over the projection (OLMo2) included;
- `DecoderLayer` -> add_rmsnorm (the attention's residual add and the post-attention norm), pre-norm layouts only:
  families whose norms come after the sublayer (Gemma2, Gemma3, OLMo2) keep their layer's own adds, and each
  norm runs rmsnorm;
- `TopKRouter` / `Experts` -> topk_router / moe_experts (mixture of experts);
- `ForCausalLM` -> linear_cross_entropy while training with labels (with the head's final soft cap);
- the base model (`Model`, Gemma3's `TextModel`) reads the batch's token layout once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    prefix: str  # class-name prefix in the family's modeling file
    norm_offset: float = 0.0  # Gemma: the norm scales by (1 + weight)
    pre_norm_layer: bool = True  # decoder layer = x + attn(norm(x)), then norm before the MLP: add_rmsnorm fuses them
    head_softcap: bool = False  # the LM head applies config.final_logit_softcapping
    layernorm: bool = False  # its norms are torch.nn.LayerNorm (GPT-NeoX): opport.layernorm

    def kinds(self) -> dict:
        """Class name after the prefix -> the kind of patched forward that takes it over."""
        kinds = dict(KINDS)
        if not self.pre_norm_layer:
            del kinds["DecoderLayer"]
        return kinds


KINDS = {"RMSNorm": "rmsnorm", "MLP": "mlp", "Attention": "attention", "DecoderLayer": "add_rmsnorm",
         "TopKRouter": "topk_router", "Experts": "moe_experts", "ForCausalLM": "linear_cross_entropy",
         "LMHeadModel": "linear_cross_entropy",
         "Model": "inputs", "TextModel": "inputs"}

FAMILIES = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3"),
    "phi3": Family("Phi3"),
    "olmo2": Family("Olmo2", pre_norm_layer=False),
    "gemma2": Family("Gemma2", norm_offset=1.0, pre_norm_layer=False, head_softcap=True),
    "gemma3_text": Family("Gemma3", norm_offset=1.0, pre_norm_layer=False, head_softcap=True),
    "gpt_neox": Family("GPTNeoX", pre_norm_layer=False, layernorm=True),
    "gpt2": Family("GPT2", pre_norm_layer=False, layernorm=True),
    "mixtral": Family("Mixtral"),
    "qwen3_moe": Family("Qwen3Moe"),
}

def head_softcap(config) -> float | None:
    """The final-logit soft cap the model's own head applies: config.final_logit_softcapping where the family's
    head applies it (Gemma), else None (Llama's heads ignore the setting)."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    return getattr(config, "final_logit_softcapping", None) if family is not None and family.head_softcap else None


# a gated MLP's activation module (transformers.activations class name) -> (op, its keyword arguments):
# swiglu(gate, up), or gelu(gate) · up
MLP_ACTIVATIONS = {"SiLUActivation": ("swiglu", {}), "SiLU": ("swiglu", {}),
                   "GELUTanh": ("gelu", {"approximate": "tanh"}), "NewGELUActivation": ("gelu", {"approximate": "tanh"}),
                   "GELUActivation": ("gelu", {"approximate": "none"})}


def table_rows() -> list:
    """(model_type, class prefix, what each module kind runs) for docs/integration.md."""
    rows = []
    for model_type, fam in FAMILIES.items():
        norm = "layernorm" if fam.layernorm else "rmsnorm (1 + weight)" if fam.norm_offset else "rmsnorm"
        layer = "add_rmsnorm" if fam.pre_norm_layer else f"its own adds; each norm {norm.split()[0]}"
        head = "linear_cross_entropy" + (" (final soft cap)" if fam.head_softcap else "")
        rows.append((model_type, fam.prefix, norm, layer, head))
    return rows
