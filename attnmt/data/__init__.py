"""Data: reading and validating parallel text, the tokenizer, the encoded store, batches and their
sampler, files that are complete or absent, forked workers. Imports only the ground floor
(config, device, errors).
"""
