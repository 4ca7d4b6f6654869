"""What is built on a trained model: the HTTP server and its page, export to CTranslate2,
distillation, training-curve figures, attention heatmaps. Imports training and what is below it.
"""
