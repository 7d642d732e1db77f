"""Checkpoints: references and loading (`loading`, `gguf`, `packaged`), where each family
keeps its blocks (`architectures`), their dims (`shape`) and memory (`memory`,
`safetensors_index`), surgery in memory (`surgery`) and on files (`file_surgery`), a
variant stored as what it changes (`variant_manifest`), streaming a model larger than
memory (`streaming`), content fingerprints (`fingerprint`) and perplexity with plain
forward passes (`perplexity`).
"""
