"""Evaluating a variant: perplexity and zero-shot backends (transformers, vLLM),
corpora, lm-eval tasks, speed and memory."""
