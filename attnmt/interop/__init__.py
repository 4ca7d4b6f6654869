"""Models in and out: import of Hugging Face MarianMT (huggingface) and native Marian (marian)
models, export to Hugging Face (huggingface) and CTranslate2 (ctranslate2). Every file it reads
is untrusted. Imports decoding and what is below it.
"""
