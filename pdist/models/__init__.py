"""The models, each with its parallel plan (docs/design.md, "Adding a model").

    causal_lm.py   what every causal LM shares: embed -> blocks -> head, init, meta init, generate
    gpt.py         GPT-2 with Hugging Face's names and shapes
    llama.py       Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention) with HF's names and shapes
    registry.py    the models by Hugging Face's model_type ("gpt2", "llama")
"""
