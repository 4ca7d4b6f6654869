"""Decoding: search (greedy, beam, sampling), forced decoding, ensembles, translating and scoring
lists, a request checked once (request), the public Translator, and what it writes beside a
translation (heatmap: --attention's maps). Imports models, data, kernels and the ground floor.
"""
