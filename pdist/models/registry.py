"""The models by Hugging Face's ``model_type``: "gpt2" -> GPT, "llama" -> Llama.

    cfg = registry.config_class("llama")(n_layer=2, ...)
    model = registry.build(cfg, seed=0)              # the model class its config names
"""
from pdist.models.gpt import GPT, GPTConfig
from pdist.models.llama import Llama, LlamaConfig

MODELS = {"gpt2": (GPTConfig, GPT), "llama": (LlamaConfig, Llama)}


def _entry(model_type):
    if model_type not in MODELS:
        raise ValueError(f"unknown model_type {model_type!r}: pdist has {sorted(MODELS)}")
    return MODELS[model_type]


def config_class(model_type):
    """GPTConfig or LlamaConfig."""
    return _entry(model_type)[0]


def build(cfg, seed=0, device=None):
    """The model of config ``cfg`` (its class's ``model_type``), initialized from ``seed``."""
    return _entry(type(cfg).model_type)[1](cfg, seed=seed, device=device)


__all__ = ["MODELS", "config_class", "build"]
