"""The models, each with its parallel plan (docs/design.md, "Adding a model").

    gpt.py     GPT-2 with Hugging Face's names and shapes
"""
