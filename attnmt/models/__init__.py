"""Models: the Seq2Seq interface, attention, the GRU and Transformer architectures (with the
Transformer's lean and compiled decoding steps), building one from its config, and the model
directory on disk. Imports data, kernels and the ground floor.
"""
