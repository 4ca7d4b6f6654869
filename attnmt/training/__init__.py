"""Training: the loop and its parts (setup, step, validation), schedules, resume state,
checkpoints, the run's log, fine-tuning, DDP, data preparation and dev/test scoring, the
training curves it draws (plot) and the corpus a teacher translates for a student (distill).
Imports decoding and what is below it.
"""
