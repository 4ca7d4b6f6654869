"""Decoding: search (greedy, beam, sampling), forced decoding, ensembles, translating and scoring
lists, and the public Translator. Imports models, data, kernels and the ground floor.
"""
